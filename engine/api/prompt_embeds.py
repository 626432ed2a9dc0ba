"""vLLM's ``prompt_embeds``: a prompt given as its input embeddings, not as text or ids.

A ``[tokens, hidden]`` tensor (float32, float16 or bfloat16; a leading batch dimension of
one is dropped, as vLLM drops it) becomes a prompt of that many placeholder tokens and one
:class:`~engine.messages.ImageInput` with ``embeds`` set, whose "pixels" are the rows
themselves: the model runner puts them in place of the placeholders' token embeddings, as
it puts a vision encoder's output (``ModelRunner._image_embeds``), and the prefix cache
keys the prompt by their content hash, so equal embeddings share blocks. Over HTTP the
tensor arrives as the base64 of ``torch.save``'s bytes, read with torch's weights-only
loader, as vLLM reads it.

Taken only with ``--enable-prompt-embeds`` (``EngineConfig.enable_prompt_embeds``), on the
decoders whose forward takes embeddings (the Llama-style layers and GPT-2 / OPT); what a
prompt of placeholders cannot answer (its prompt logprobs, a repetition penalty, which
reads the prompt's ids, a beam search) is refused by name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from engine.errors import InvalidParamError
from engine.messages import ImageInput
from engine.models.config import GEMMA_FAMILY

PARAM = "prompt_embeds"
# The id each placeholder position carries (its embedding is replaced; nothing reads it).
PLACEHOLDER_ID = 0


def decode_base64(text: Any, param: str = PARAM) -> Any:
    """The tensor in one base64 string of ``torch.save`` output (weights-only: no code
    runs); a 400-style :class:`InvalidParamError` for anything else."""
    import torch

    if not isinstance(text, str) or not text:
        raise InvalidParamError("prompt_embeds must be base64 text of a torch.save'd tensor "
                                "(or a list of them)", param=param)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParamError("prompt_embeds is not base64 text", param=param) from None
    try:
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:
        # Whatever the client's bytes make torch's weights-only unpickler raise (it runs
        # no code and builds only tensors and plain containers): the client's error.
        raise InvalidParamError(f"prompt_embeds is not a torch.save'd tensor "
                                f"({type(exc).__name__})", param=param) from None


def check_model(model_config: Any, pooling: bool, pipeline_stages: int) -> None:
    """Refuse prompt_embeds where this engine cannot put them in the model's input."""
    if model_config is None or pooling or model_config.is_encoder:
        raise InvalidParamError("prompt_embeds needs a generating decoder model", param=PARAM)
    if model_config.architecture in GEMMA_FAMILY or model_config.embedding_multiplier != 1 or model_config.mrope:
        raise InvalidParamError(f"prompt_embeds is not supported for {model_config.architecture} "
                                "models (their input scaling / M-RoPE positions)", param=PARAM)
    if pipeline_stages > 1:
        raise InvalidParamError("prompt_embeds is not supported with pipeline parallelism",
                                param=PARAM)


def embeds_input(tensor: Any, *, hidden_size: int, truncate: int | None,
                 param: str = PARAM) -> tuple[tuple[int, ...], ImageInput]:
    """The placeholder prompt and the embeddings input for ``tensor`` [tokens, hidden];
    ``truncate`` keeps its last rows (``truncate_prompt_tokens``, resolved)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidParamError("prompt_embeds must be a torch tensor", param=param)
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidParamError(f"prompt_embeds must be float32, float16 or bfloat16, not "
                                f"{str(tensor.dtype).removeprefix('torch.')}", param=param)
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[1] != hidden_size or tensor.shape[0] < 1:
        raise InvalidParamError(f"prompt_embeds must be [tokens, {hidden_size}] (the model's "
                                f"hidden size), not {list(tensor.shape)}", param=param)
    if truncate is not None:
        tensor = tensor[-truncate:]
    rows = tensor.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(rows).all()):
        raise InvalidParamError("prompt_embeds holds NaN or infinite values", param=param)
    pixels = rows.numpy().astype("<f4", copy=False).tobytes()
    shape = (int(rows.shape[0]), hidden_size)
    key = int.from_bytes(hashlib.sha256(repr(shape).encode() + pixels).digest()[:8], "little") >> 1
    return (PLACEHOLDER_ID,) * shape[0], ImageInput(0, shape[0], key, pixels, shape, embeds=True)
