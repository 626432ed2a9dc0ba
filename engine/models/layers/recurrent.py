"""What the recurrent mixers (Mamba-2: ``layers/mamba.py``; Gated DeltaNet:
``layers/deltanet.py``) share: a step's requests split into decode rows and prompt chunks,
each request's states found by its slot, and the causal convolution both run before their
recurrence.

A layer's states are two tensors indexed by slot (``AttentionMetadata.state_slots``):
``conv_state [slots, channels, d_conv - 1]`` (the last inputs, model dtype) and
``state [slots, ...]`` (fp32). Decode rows (one token on a context) are updated together;
where their slots run in order (``k, k+1, ...``: the usual case, slots being handed out
lowest first) through views of the state tensors, in place, else gathered and written
back. A prompt chunk at position 0 starts from zero states.

The prefix cache's state checkpoints (``AttentionMetadata.state_loads`` / ``state_saves``,
engine.runner.state_slots) are more slots of the same tensors: every load of the step is
copied into its request's slot before any request is mixed (a checkpoint saved later in
the step may be the one loaded), and a chunk with saves runs in parts, its states copied
out between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.ops import AttentionMetadata


def mix_by_request(
    meta: AttentionMetadata, out: torch.Tensor,
    decode: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, tuple[int, ...]], torch.Tensor],
    chunk: Callable[[int, int, int, bool], torch.Tensor],
    states: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Fill ``out`` (the step's T rows) by request: ``decode(pick, slots, host_slots)`` once
    for every decode row (``pick(t)`` gives those rows of a [T, ...] tensor), then
    ``chunk(lo, hi, slot, fresh)`` for each other request's rows ``lo:hi``. ``states`` are
    the layer's ``(conv_state, state)``, which the checkpoints are copied in and out of."""
    assert meta.state_slots is not None  # the runner gives a hybrid model's steps slots
    slots = meta.state_slots_host
    loaded = set()
    for b, src in meta.state_loads:
        _copy_slot(states, src, slots[b])
        loaded.add(b)
    saves: dict[int, list[tuple[int, int]]] = {}
    for b, offset, dst in meta.state_saves:  # ascending offsets within a request
        saves.setdefault(b, []).append((offset, dst))
    rows_of = [b for b, (n, s) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True))
               if n == 1 and s > 1]
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    if rows_of:
        if len(rows_of) == len(slots):  # a decode-only step: every row, in order
            out.copy_(decode(lambda t: t, meta.state_slots, slots))
        else:
            rows = torch.tensor([starts[b] for b in rows_of], device=out.device)
            got = decode(lambda t: t.index_select(0, rows), meta.state_slots[rows_of],
                         tuple(slots[b] for b in rows_of))
            out.index_copy_(0, rows, got)
    decoded = set(rows_of)
    for b in range(len(slots)):
        lo, hi = starts[b], starts[b + 1]
        # fresh: the chunk starts the request (and no checkpoint was loaded for it)
        fresh = meta.seq_lens_host[b] == hi - lo and b not in loaded
        done = 0 if b not in decoded else hi - lo
        for offset, dst in saves.get(b, ()):
            if offset > done:  # the chunk's part up to the checkpoint
                out[lo + done:lo + offset] = chunk(lo + done, lo + offset, slots[b], fresh and done == 0)
                done = offset
            _copy_slot(states, slots[b], dst)
        if done < hi - lo:
            out[lo + done:hi] = chunk(lo + done, hi, slots[b], fresh and done == 0)
    return out


def decode_only(meta: AttentionMetadata) -> bool:
    """Whether every request of the step is one token on a context (and none starts from
    a checkpoint): the rows :func:`mix_by_request` would hand to ``decode`` all at once."""
    return (not meta.state_loads and meta.state_slots is not None
            and all(n == 1 and s > 1 for n, s in zip(meta.query_lens_host, meta.seq_lens_host, strict=True)))


def save_after_decode(meta: AttentionMetadata, states: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A decode-only step's checkpoint saves (each after its request's token), as
    :func:`mix_by_request` makes them."""
    slots = meta.state_slots_host
    for b, _, dst in meta.state_saves:
        _copy_slot(states, slots[b], dst)


def _copy_slot(states: tuple[torch.Tensor, torch.Tensor], src: int, dst: int) -> None:
    for t in states:
        t[dst].copy_(t[src])


def slot_views(conv_state: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
               host: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The decode rows' ``(conv, state, in_place)``: views of a run of slots, else copies
    (:func:`write_back` them after)."""
    n = len(host)
    if host == tuple(range(host[0], host[0] + n)):
        return conv_state[host[0]:host[0] + n], state[host[0]:host[0] + n], True
    return conv_state.index_select(0, slots), state.index_select(0, slots), False


def write_back(conv_state: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, conv: torch.Tensor,
               new: torch.Tensor, in_place: bool) -> None:
    if not in_place:
        conv_state.index_copy_(0, slots, conv)
        state.index_copy_(0, slots, new)


def conv_prompt(conv_state: torch.Tensor, slot: int, fresh: bool, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's tokens ``x`` [n, channels] through the causal convolution after the slot's
    window (zeros when ``fresh``), which then holds the chunk's last inputs. SiLU'd, fp32,
    [n, channels]."""
    width = conv_state.shape[-1]
    prior = torch.zeros_like(conv_state[slot]) if fresh else conv_state[slot]
    seq = torch.cat([prior, x.t().to(conv_state.dtype)], dim=-1)  # [channels, width + n]
    conv_state[slot] = seq[:, seq.shape[1] - width:]
    mixed = F.conv1d(seq.float().unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    return F.silu(mixed.t())


__all__ = ["conv_prompt", "decode_only", "mix_by_request", "save_after_decode", "slot_views", "write_back"]
