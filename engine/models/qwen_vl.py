"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision transformer with 2-D rotary positions and a
patch merger in front of a Qwen2 (Qwen3-VL: Qwen3) decoder whose RoPE has three position
streams (M-RoPE).

An image arrives preprocessed by transformers' ``Qwen2VLImageProcessor``: resized so each
side is a multiple of ``patch_size * spatial_merge_size`` (within the pixel budget), cut
into ``t x h x w`` patches of ``in_channels x temporal_patch_size x patch x patch`` values
(a still image is its frame twice: ``t = 1``), each ``merge x merge`` block of patches
consecutive. The tower (:class:`QwenVisionTower`):

* patch embedding: the Conv3d whose kernel is its stride, i.e. one matmul per patch
  (Qwen3-VL's has a bias, and adds a learned position table: a square grid resampled
  bilinearly, corners aligned, to the image's patch grid);
* 2-D RoPE: the first half of each head's frequencies rotate by the patch's row, the
  second half by its column (``head_dim / 4`` frequencies each, base ``rope_theta``);
* blocks: Qwen2-VL's and Qwen3-VL's are pre-LayerNorm with a two-linear MLP (QuickGELU;
  tanh GELU), every block attending over its whole frame; Qwen2.5-VL's are pre-RMSNorm
  with a SwiGLU MLP (biased), and attend within windows of ``window_size`` pixels
  (patches reordered window by window) except the ``fullatt_block_indexes`` blocks,
  which see the whole frame;
* the merger: a norm, then each ``merge x merge`` block of patches concatenated into one
  vector and an MLP (Linear, GELU, Linear) to the decoder's width: one embedding per
  placeholder token.
* Qwen3-VL's DeepStack: the outputs of the ``deepstack_visual_indexes`` blocks, each
  through a merger of its own (its norm after the concatenation), are added to the
  image's rows of the hidden states after decoder layers 0, 1, ... The tower hands the
  runner one row per placeholder holding the embedding and these features side by side;
  :meth:`QwenVLModel.forward` splits them.

M-RoPE (:func:`mrope_positions`): a text token's three positions are equal and count up;
an image's placeholders take (temporal, row, column) positions on its merged grid, offset
by the position the image starts at; the text after it continues from the largest
position so far plus one. Generated tokens sit at ``index + delta``
(``delta = max position + 1 - prompt length``), on all three streams. The decoder rotates
frequency ``j`` of each head by the stream that ``mrope_section`` assigns to ``j``
(consecutive sections; Qwen3-VL's interleaved T, H, W): the model gathers one cos/sin row
per token (:meth:`QwenVLModel.forward`) and hands the usual ``rotary_embedding`` op that
per-token table, so every op set runs M-RoPE.

Weights: transformers 5 saves ``model.language_model.*`` / ``model.visual.*`` /
``lm_head.weight``; the hub's older checkpoints ``model.*`` / ``visual.*``. Both map to
``model.*`` and ``visual.*`` (:func:`normalize_qwen_vl_names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError
from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.models.vision_config import QwenVisionConfig
from engine.ops import AttentionMetadata, Ops
from engine.pixels import unpack


def normalize_qwen_vl_names(name: str) -> str:
    """A Qwen-VL checkpoint's tensor name under the engine's names."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def qwen_vision_weight_names(vision: QwenVisionConfig) -> list[str]:
    """The vision tower's and merger's tensors the engine reads."""
    v = "visual."
    layer_norm = vision.kind != "qwen2_5_vl"
    names = [v + "patch_embed.proj.weight"]
    if vision.qwen3:
        names += [v + "patch_embed.proj.bias", v + "pos_embed.weight"]

    def norm(name: str) -> list[str]:
        return [name + ".weight"] + ([name + ".bias"] if layer_norm else [])

    for i in range(vision.depth):
        p = f"{v}blocks.{i}."
        names += norm(p + "norm1") + norm(p + "norm2")
        for lin in ("attn.qkv", "attn.proj", *_mlp_names(vision.kind)):
            names += [p + lin + ".weight", p + lin + ".bias"]
    for norm_name, linears in _merger_names(vision):
        names += norm(norm_name)
        for lin in linears:
            names += [lin + ".weight", lin + ".bias"]
    return names


def _mlp_names(kind: str) -> tuple[str, ...]:
    if kind == "qwen2_vl":
        return ("mlp.fc1", "mlp.fc2")
    if kind == "qwen2_5_vl":
        return ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    return ("mlp.linear_fc1", "mlp.linear_fc2")


def _merger_names(vision: QwenVisionConfig) -> list[tuple[str, tuple[str, str]]]:
    """(norm, (linear 1, linear 2)) of the merger, then of each DeepStack merger."""
    v = "visual."
    if not vision.qwen3:
        return [(v + "merger.ln_q", (v + "merger.mlp.0", v + "merger.mlp.2"))]
    prefixes = [v + "merger."] + [f"{v}deepstack_merger_list.{j}." for j in
                                  range(len(vision.deepstack_visual_indexes))]
    return [(p + "norm", (p + "linear_fc1", p + "linear_fc2")) for p in prefixes]


def image_token_count(grid: Sequence[int], merge: int) -> int:
    """Placeholder tokens of an image of ``grid = (t, h, w)`` patches."""
    t, h, w = grid
    return t * h * w // (merge * merge)


def mrope_positions(length: int, images: Sequence[Any], merge: int) -> tuple[torch.Tensor, int]:
    """``([3, length] int64 positions of the prompt, delta)`` for M-RoPE, as transformers'
    ``get_rope_index`` computes them. ``images``: objects with ``offset``, ``length`` and
    ``grid`` (``ImageInput``), not overlapping. Tokens past the prompt sit at
    ``index + delta`` on every stream."""
    pos = torch.empty(3, length, dtype=torch.int64)
    at = 0  # the next prompt index
    nxt = 0  # the next text position
    top = -1  # the largest position so far
    for image in sorted(images, key=lambda im: im.offset):
        n = image.offset - at
        pos[:, at : image.offset] = torch.arange(nxt, nxt + n)
        nxt += n
        top = max(top, nxt - 1)
        t, h, w = image.grid
        gh, gw = h // merge, w // merge
        end = image.offset + image.length
        pos[0, image.offset : end] = nxt + torch.arange(t).repeat_interleave(gh * gw)
        pos[1, image.offset : end] = nxt + torch.arange(gh).repeat_interleave(gw).repeat(t)
        pos[2, image.offset : end] = nxt + torch.arange(gw).repeat(t * gh)
        top = max(top, nxt + max(t, gh, gw) - 1)
        nxt += max(h, w) // merge
        at = end
    pos[:, at:] = torch.arange(nxt, nxt + length - at)
    if length > at:
        top = max(top, nxt + length - at - 1)
    return pos, top + 1 - length


def mrope_streams(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """The stream (0 temporal, 1 row, 2 column) each of the ``sum(section)`` frequencies
    turns by: consecutive sections (Qwen2-VL), or Qwen3-VL's interleaving, where frequency
    ``j`` is the row's when ``j % 3 == 1`` and ``j < 3 * section[1]``, the column's when
    ``j % 3 == 2`` and ``j < 3 * section[2]``, and the temporal stream's otherwise."""
    if not interleaved:
        return torch.cat([torch.full((s,), i % 3) for i, s in enumerate(section)])
    j = torch.arange(sum(section))
    stream = torch.zeros_like(j)
    for k in (1, 2):
        stream[(j % 3 == k) & (j < 3 * section[k])] = k
    return stream


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@dataclasses.dataclass(slots=True)
class _Block:
    norm1: tuple[torch.Tensor, torch.Tensor | None]
    norm2: tuple[torch.Tensor, torch.Tensor | None]
    qkv: tuple[torch.Tensor, torch.Tensor]
    proj: tuple[torch.Tensor, torch.Tensor]
    mlp: list[tuple[torch.Tensor, torch.Tensor]]  # fc1, fc2 | gate, up, down


@dataclasses.dataclass(slots=True)
class _Merger:
    norm: tuple[torch.Tensor, torch.Tensor | None]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]
    after: bool  # the norm over the concatenated merge block (DeepStack's), not each patch


class QwenVisionTower:
    """Qwen2-VL's / Qwen2.5-VL's vision transformer and patch merger: images' patches
    ``[sum of t*h*w, C*T*P*P]`` and grids -> one ``[tokens, out_hidden]`` per image."""

    def __init__(self, vision: QwenVisionConfig, get: ShardedWeights) -> None:
        self.cfg = vision
        self.layer_norm = vision.kind != "qwen2_5_vl"
        v = "visual."
        patch = get(v + "patch_embed.proj.weight")
        width = vision.hidden_size
        expected = (width, vision.in_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        if tuple(patch.shape) != expected:
            raise CorruptModelError(f"visual.patch_embed.proj.weight is {tuple(patch.shape)}; the "
                                    f"vision config gives {expected}")
        # The Conv3d's kernel equals its stride: a matmul over each flattened patch.
        self.patch_weight = patch.reshape(width, -1)
        self.patch_bias = get(v + "patch_embed.proj.bias") if vision.qwen3 else None
        self.pos_embed = None
        if vision.qwen3:
            table = get(v + "pos_embed.weight")
            side = int(round(vision.num_position_embeddings ** 0.5))
            if tuple(table.shape) != (side * side, width):
                raise CorruptModelError(f"visual.pos_embed.weight is {tuple(table.shape)}; the vision "
                                        f"config gives {(side * side, width)}")
            # [1, width, side, side]: the grid F.interpolate resamples to each image's.
            self.pos_embed = table.float().T.reshape(1, width, side, side)
        self.blocks = [self._block(get, i) for i in range(vision.depth)]

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(name + ".weight"), get(name + ".bias")

        self.mergers = [_Merger(self._norm(get, norm), wb(fc1), wb(fc2), after=j > 0)
                        for j, (norm, (fc1, fc2)) in enumerate(_merger_names(vision))]
        head = width // vision.num_heads
        quarter = head // 2
        self.inv_freq = 1.0 / (vision.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))

    def _norm(self, get: ShardedWeights, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return get(name + ".weight"), get(name + ".bias") if self.layer_norm else None

    def _block(self, get: ShardedWeights, i: int) -> _Block:
        p = f"visual.blocks.{i}."

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(p + name + ".weight"), get(p + name + ".bias")

        return _Block(self._norm(get, p + "norm1"), self._norm(get, p + "norm2"), wb("attn.qkv"),
                      wb("attn.proj"), [wb(name) for name in _mlp_names(self.cfg.kind)])

    def _apply_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        weight, bias = norm
        if self.layer_norm:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-6)
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        cfg = self.cfg
        m = cfg.spatial_merge_size
        unit = m * m
        x = F.linear(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias)  # [N, width]
        n = x.shape[0]
        rows, cols = _patch_coordinates(grids, m)
        if self.pos_embed is not None:
            x = x + self._learned_positions(grids, rows, cols).to(x.dtype)
        freqs = torch.stack([rows, cols], -1).float().unsqueeze(-1) * self.inv_freq  # [N, 2, F]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1).to(x.device)  # [N, head]
        frames = _frame_segments(grids)
        windows = None
        order = None
        if cfg.window_size:
            order, windows = _window_order(grids, m, cfg.window_size // m // cfg.patch_size)
            # Reorder whole merge units so that each window's patches are consecutive.
            x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
            angles = angles.view(n // unit, unit, -1)[order.to(angles.device)].reshape(n, -1)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [N, 1, head] fp32
        deep = []
        for i, block in enumerate(self.blocks):
            segments = frames if windows is None or i in cfg.fullatt_block_indexes else windows
            x = self._forward_block(block, x, cos, sin, segments)
            if i in cfg.deepstack_visual_indexes:  # in block order, each with its own merger
                deep.append(self._merge(x, self.mergers[1 + cfg.deepstack_visual_indexes.index(i)]))
        # One row per placeholder: the embedding, then each DeepStack feature beside it.
        h = torch.cat([self._merge(x, self.mergers[0]), *deep], dim=-1)
        if order is not None:
            h = h[torch.argsort(order).to(h.device)]
        counts = [image_token_count(g, m) for g in grids]
        return list(h.split(counts))

    def _merge(self, x: torch.Tensor, merger: _Merger) -> torch.Tensor:
        """Each ``merge x merge`` block of patches' rows -> one row of the decoder's width."""
        unit = self.cfg.spatial_merge_size ** 2
        if merger.after:
            h = self._apply_norm(x.reshape(x.shape[0] // unit, -1), merger.norm)
        else:
            h = self._apply_norm(x, merger.norm).reshape(x.shape[0] // unit, -1)
        return F.linear(F.gelu(F.linear(h, *merger.fc1)), *merger.fc2)

    def _learned_positions(self, grids: Sequence[Sequence[int]], rows: torch.Tensor,
                           cols: torch.Tensor) -> torch.Tensor:
        """Qwen3-VL: each patch's position embedding [N, width], the square table resampled
        bilinearly (corners aligned) to its image's ``h x w`` grid, every frame alike."""
        assert self.pos_embed is not None
        out, at = [], 0
        for t, h, w in grids:
            grid = F.interpolate(self.pos_embed, size=(h, w), mode="bilinear", align_corners=True)[0]
            r, c = rows[at : at + h * w], cols[at : at + h * w]
            out.append(grid[:, r, c].T.repeat(t, 1))
            at += t * h * w
        return torch.cat(out).to(self.patch_weight.device)

    def _forward_block(self, block: _Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       segments: list[tuple[int, int]]) -> torch.Tensor:
        cfg = self.cfg
        n, d = x.shape
        heads = cfg.num_heads
        h = self._apply_norm(x, block.norm1)
        q, k, v = F.linear(h, *block.qkv).view(n, 3, heads, d // heads).unbind(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        o = _segment_attention(q, k, v, segments)
        x = x + F.linear(o.reshape(n, d), *block.proj)
        h = self._apply_norm(x, block.norm2)
        if self.layer_norm:
            fc1, fc2 = block.mlp
            h = F.linear(_act(cfg.hidden_act, F.linear(h, *fc1)), *fc2)
        else:
            gate, up, down = block.mlp
            h = F.linear(_act(cfg.hidden_act, F.linear(h, *gate)) * F.linear(h, *up), *down)
        return x + h


def _patch_coordinates(grids: Sequence[Sequence[int]], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in its image, in the processor's patch order (merge
    blocks of ``m x m`` patches consecutive, frames one after another)."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _frame_segments(grids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(start, length) of each frame's patches: full attention stays within a frame."""
    out, at = [], 0
    for t, h, w in grids:
        for _ in range(t):
            out.append((at, h * w))
            at += h * w
    return out


def _window_order(grids: Sequence[Sequence[int]], m: int, window: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Qwen2.5-VL's windows: the merge units (``m x m`` patches) reordered window by window
    (``window x window`` units, row-major within each, the last row and column of
    windows cut short), and each window's (start, length) in patches."""
    if window < 1:
        raise CorruptModelError("Qwen2.5-VL window_size is smaller than one merged patch")
    order: list[torch.Tensor] = []
    segments: list[tuple[int, int]] = []
    base = at = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        units = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for f in range(t):
            for r0 in range(0, gh, window):
                for c0 in range(0, gw, window):
                    block = units[f, r0 : r0 + window, c0 : c0 + window].reshape(-1)
                    order.append(block)
                    segments.append((at, block.numel() * m * m))
                    at += block.numel() * m * m
        base += t * gh * gw
    return torch.cat(order), segments


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       segments: list[tuple[int, int]]) -> torch.Tensor:
    """Bidirectional attention within each segment of rows ([N, heads, head] each); the
    segments of one length run as one batch."""
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, length in segments:
        by_length.setdefault(length, []).append(start)
    for length, starts in by_length.items():
        idx = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1).to(q.device)
        shape = (len(starts), length, *q.shape[1:])
        o = F.scaled_dot_product_attention(*(t[idx].view(shape).transpose(1, 2) for t in (q, k, v)))
        out[idx] = o.transpose(1, 2).reshape(idx.numel(), *q.shape[1:])
    return out


class QwenVLModel(Decoder):
    """The Qwen2 decoder with M-RoPE and a Qwen-VL vision tower whose outputs replace the
    input embeddings at image placeholder positions."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, QwenVisionConfig)
        return decoder_weight_names(config) + qwen_vision_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return normalize_qwen_vl_names(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device)
        vision = config.vision
        assert isinstance(vision, QwenVisionConfig)
        self.vision = QwenVisionTower(vision, ShardedWeights(weights, dtype, self.device))
        # Frequency j (of head_dim / 2, cos and sin halves alike) turns by stream stream[j].
        stream = mrope_streams(vision.mrope_section, vision.mrope_interleaved)
        self._mrope_stream = torch.cat([stream, stream]).to(self.device)
        self._mrope_column = torch.arange(config.head_dim, device=self.device)

    def prompt_positions(self, length: int, images: Sequence[Any]) -> tuple[torch.Tensor, int]:
        """A prompt's ``([3, length] M-RoPE positions, delta)`` (:func:`mrope_positions`):
        what the runner keeps per request of a model whose ``config.mrope`` is set."""
        return mrope_positions(length, images, self.vision.cfg.spatial_merge_size)

    def encode_image_inputs(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """``ImageInput``s (``pixels`` of ``shape`` [t*h*w, C*T*P*P], or [t*h*w, C*P*P] for
        a still image's one frame; ``grid`` (t, h, w)) -> one ``[tokens, hidden]``
        embedding per image, in the model dtype."""
        cfg = self.vision.cfg
        area = cfg.patch_size * cfg.patch_size
        parts = []
        for im in images:
            patches = unpack(im.pixels, im.shape)
            if im.shape[1] == cfg.in_channels * area:  # one frame: repeat it T times
                patches = patches.view(-1, cfg.in_channels, 1, area).expand(
                    -1, -1, cfg.temporal_patch_size, -1).reshape(len(patches), -1)
            parts.append(patches)
        return self.vision(torch.cat(parts).to(self.device), [tuple(im.grid) for im in images])

    def mrope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, head_dim]: each token's cos/sin row, frequency j taken at the position of the
        stream ``mrope_section`` gives it (positions [3, T])."""
        rows = self.cos_sin_cache[positions]  # [3, T, head_dim]
        tokens = torch.arange(positions.shape[1], device=positions.device).unsqueeze(1)
        return rows[self._mrope_stream.unsqueeze(0), tokens, self._mrope_column.unsqueeze(0)]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,  # [3, T] (M-RoPE streams) or [T] (all three equal)
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        # Every layer rotates by this step's per-token table (row i for token i).
        table = self.mrope_table(positions)
        rows = torch.arange(positions.shape[1], device=positions.device)
        deepstack = None
        if mm_embeds is not None and self.vision.cfg.deepstack_visual_indexes:
            # Qwen3-VL: the embedding, then each DeepStack feature (added after decoder
            # layers 0, 1, ...) side by side in each placeholder's row.
            image_rows, values = mm_embeds
            parts = values.split(self.config.hidden_size, dim=-1)
            mm_embeds = (image_rows, parts[0])
            deepstack = [(image_rows, part) for part in parts[1:]]
        return self._decode(self._embed(input_ids), rows, meta, kv_caches, mm_embeds, rope=table,
                            layer_adds=deepstack)
