"""Each tensor-parallel rank reads only its slices of the checkpoint (issue 41).

A rank loads lazily (``load_model(..., lazy=True)``, what the engine's ranks do) and
builds its slice of the model: the bytes it reads from the file and the bytes its weights
hold are its share of the model's, ``1 / N``, plus the tensors every rank keeps whole
(norms). The oracle of the share is the one-rank model, loaded whole (the file's tensor
bytes, the one-rank model's resident bytes); of the values, the same rank built from the
whole checkpoint loaded eagerly and cut in memory (the path before this issue, itself
checked against one rank in test_tensor_parallel.py). No process group is needed:
building a rank's model runs no collective.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from test_loader import write_gguf
from test_moe import write_moe_gguf

from engine.models.checkpoint import LazyWeights
from engine.models.loader import default_model_path, load_model
from engine.models.registry import build_model
from engine.models.testing import write_tiny_model
from engine.ops import get_ops
from engine.ops.quant import QuantizedWeight
from engine.parallel import TensorParallel

# Attributes of a layer or projection that are not its weights.
_NOT_WEIGHTS = {"tp", "gathered", "rope", "_packed", "small_batch", "window", "top_k", "renormalize",
                "out_features", "_offsets"}


def _weights(obj, prefix: str = "") -> dict[str, object]:
    """Every tensor (and quantized weight) a model part holds, by attribute path."""
    if obj is None or isinstance(obj, int | float | bool | str):
        return {}
    if isinstance(obj, torch.Tensor | QuantizedWeight):
        return {prefix: obj}
    if isinstance(obj, list | tuple):
        return {k: v for i, item in enumerate(obj) for k, v in _weights(item, f"{prefix}[{i}]").items()}
    names = getattr(type(obj), "__slots__", None) or getattr(obj, "__dataclass_fields__", None) or vars(obj)
    return {k: v for name in names if name not in _NOT_WEIGHTS
            for k, v in _weights(getattr(obj, name, None), f"{prefix}.{name}").items()}


def _model_weights(model) -> dict[str, object]:
    out = _weights(model.layers, "layers")
    for name in ("embed", "norm", "lm_head"):
        out |= _weights(getattr(model, name), name)
    return out


def _same(a, b) -> bool:
    if isinstance(a, QuantizedWeight):
        return (isinstance(b, QuantizedWeight) and (a.fmt, a.shape, a.layout) == (b.fmt, b.shape, b.layout)
                and a.data.keys() == b.data.keys() and all(torch.equal(a.data[f], b.data[f]) for f in a.data))
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _build(path: Path, tp: TensorParallel, *, lazy: bool, dtype: str = "float32", layout: str = "auto"):
    loaded = load_model(path, dtype=dtype, lazy=lazy, ops_backend="triton" if layout == "blocks" else "auto")
    model = build_model(loaded.config, loaded.weights, get_ops("torch" if layout == "blocks" else "cpu"),
                        dtype=loaded.dtype, tp=tp)
    return loaded, model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-load")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_CACHE_DIR", str(root / "cache"))  # GGUF conversions (config, tokenizer)
        wide = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 192}
        out = {
            # safetensors in bf16, read into an fp32 model: each cut is cast as it is read.
            "qwen3-bf16": write_tiny_model(root / "qwen3", "qwen3", overrides={"torch_dtype": "bfloat16"}),
            "phi3": write_tiny_model(root / "phi3", "phi3"),  # fused q/k/v and gate/up, cut per part
            "qwen2_moe": write_tiny_model(root / "qwen2_moe", "qwen2_moe"),  # experts, a gated shared expert
        }
        folder = out["qwen3-bf16"]
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        save_file({k: v.bfloat16() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        llama = write_tiny_model(root / "llama", "llama", overrides=wide)
        # llama.cpp's q/k row permutation undone on the heads a rank reads, blocks kept.
        out["llama-Q4_1.gguf"] = write_gguf(llama, root / "llama-Q4_1.gguf", quant=gguf.GGMLQuantizationType.Q4_1)
        llama3 = write_tiny_model(root / "llama3", "llama3")  # one KV head, copied to both ranks
        out["llama3-Q8_0.gguf"] = write_gguf(llama3, root / "llama3-Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
        out["qwen2-F16.gguf"] = write_gguf(write_tiny_model(root / "qwen2", "qwen2"), root / "qwen2-F16.gguf",
                                           quant=gguf.GGMLQuantizationType.F16)  # dense, q/k/v biases
        out["qwen2_moe-Q8_0.gguf"] = write_moe_gguf(out["qwen2_moe"], root / "qwen2_moe-Q8_0.gguf",
                                                    quant=gguf.GGMLQuantizationType.Q8_0)  # expert stacks
        for path in out.values():  # convert once here (config and tokenizer)
            load_model(path, dtype="float32", lazy=True)
        yield out


CUTS = [("qwen3-bf16", 2), ("phi3", 2), ("qwen2_moe", 2), ("llama-Q4_1.gguf", 2), ("llama-Q4_1.gguf", 3),
        ("llama3-Q8_0.gguf", 2), ("qwen2-F16.gguf", 2), ("qwen2_moe-Q8_0.gguf", 2)]


@pytest.mark.parametrize(("key", "world_size"), CUTS, ids=[f"{k}-tp{n}" for k, n in CUTS])
def test_a_rank_read_lazily_holds_the_cuts_of_the_whole_checkpoint(
    key: str, world_size: int, checkpoints: dict[str, Path], one_thread: None
) -> None:
    for rank in range(world_size):
        tp = TensorParallel(rank, world_size)
        _, whole = _build(checkpoints[key], tp, lazy=False)
        loaded, lazy = _build(checkpoints[key], tp, lazy=True)
        assert isinstance(loaded.weights, LazyWeights)
        want, got = _model_weights(whole), _model_weights(lazy)
        assert got.keys() == want.keys()
        differ = [name for name in want if not _same(want[name], got[name])]
        assert not differ, f"rank {rank} of {world_size}: {differ[:4]}"


def test_a_column_cut_in_gguf_block_rows_reads_whole_blocks(checkpoints: dict[str, Path]) -> None:
    """GGUF's block rows (the Triton layout) are split by input columns for o and down: a
    lazy rank reads each row's run of its blocks, equal to the eager cut."""
    tp = TensorParallel(1, 2)
    _, whole = _build(checkpoints["llama3-Q8_0.gguf"], tp, lazy=False, layout="blocks")
    _, lazy = _build(checkpoints["llama3-Q8_0.gguf"], tp, lazy=True, layout="blocks")
    o = lazy.layers[0].o_proj
    assert not o.gathered and o.linear.parts[0].layout == "blocks"
    want, got = _model_weights(whole), _model_weights(lazy)
    assert all(_same(want[name], got[name]) for name in want)


# (checkpoint, ranks): SmolLM2's GGUF over its 3 ranks, and a safetensors model at 2 and 3.
SHARES = [("smollm2", 3), ("llama-wide", 2), ("llama-wide", 3)]


def _held(model) -> int:
    """Bytes of the weights a model holds, each counted once (a tied head is the
    embedding; a dense projection's packed copy for oneDNN is left out: its padding is
    oneDNN's)."""
    seen = {id(w): w for w in _model_weights(model).values()}
    return sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in seen.values())


@pytest.mark.parametrize(("key", "world_size"), SHARES, ids=[f"{k}-tp{n}" for k, n in SHARES])
def test_each_rank_reads_and_keeps_only_its_share_of_the_weights(
    key: str, world_size: int, tmp_path: Path, one_thread: None
) -> None:
    """Every matrix splits evenly here (the KV heads too), so a rank's share is exactly
    ``1 / N`` of the matrices plus the norms every rank keeps whole; what a rank reads from
    the file and what its weights hold are that share of the one-rank model's."""
    if key == "smollm2":
        path, header = default_model_path(), 0  # GGUF: its header is parsed, not counted
    else:
        path = write_tiny_model(tmp_path / "llama", "llama", overrides={
            "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 384,
            "tie_word_embeddings": False})
        with open(path / "model.safetensors", "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")  # read by every rank
    one, model = _build(path, TensorParallel(), lazy=True)
    read, held = one.weights.bytes_read - header, _held(model)
    # The norms: two a layer and the final one, fp32 in the file and in the model.
    norms = (2 * one.config.num_hidden_layers + 1) * one.config.hidden_size * 4
    for rank in range(world_size):
        loaded, model = _build(path, TensorParallel(rank, world_size), lazy=True)
        assert loaded.weights.bytes_read == header + (read - norms) // world_size + norms, f"rank {rank} read"
        assert _held(model) == (held - norms) // world_size + norms, f"rank {rank} holds"
