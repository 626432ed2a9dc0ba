"""The embedded trio API: open an engine in your own program and stream tokens from it.

::

    import engine

    async with engine.open_engine(dtype="float32") as eng:
        async for out in eng.generate("The capital of France is", engine.SamplingParams(max_tokens=8)):
            print(out.text, end="")

The contract is written down in ``docs/architecture.md`` ("Actors and the embedded API").
Its modules: :mod:`~engine.api.open` (``open_engine``), :mod:`~engine.api.engine` (the
``Engine`` an application talks to), :mod:`~engine.api.streams` (a request's stream) and
:mod:`~engine.api.protocol` (what the HTTP layer is typed against). The synchronous offline
API over the same engine, ``engine.LLM``, is :mod:`~engine.api.offline` (with
:mod:`~engine.api.engine_thread`, :mod:`~engine.api.batch` and :mod:`~engine.api.outputs`);
it is not imported here.
"""

from engine.actors.system import EngineStatistics
from engine.api.engine import PROMPT_THREADS, Engine, tokenize_prompt
from engine.api.open import open_engine
from engine.api.protocol import EngineLike, StreamLike
from engine.api.streams import RequestStream

__all__ = [
    "PROMPT_THREADS",
    "Engine",
    "EngineLike",
    "EngineStatistics",
    "RequestStream",
    "StreamLike",
    "open_engine",
    "tokenize_prompt",
]
