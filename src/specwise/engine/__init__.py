"""The speculative decoding engine: the only package of specwise that imports torch.

`load_target` reads weights, `make_drafter` builds a drafter from a spec string, and `Engine` runs the shared
draft-and-verify loop (a baseline is simply an engine without a drafter).
"""

try:
    import torch  # noqa: F401 - checked here so a light install says what it lacks instead of a traceback
except ImportError:
    from specwise.errors import SpecwiseError

    raise SpecwiseError(
        "this command runs the engine, which needs PyTorch and the engine's other packages; this install has only "
        "the harness. Install them with: pip install 'specwise[engine]' (for the CPU build of torch add "
        "--extra-index-url https://download.pytorch.org/whl/cpu). The harness alone can evaluate a server: "
        "specwise evaluate --endpoint URL"
    ) from None

from specwise.engine.engine import Engine, GenerationResult, StreamEvent
from specwise.engine.request import RequestOptions
from specwise.engine.sampling import SamplingParams
from specwise.engine.weights import LoadedModel, load_target

__all__ = [
    "Engine",
    "GenerationResult",
    "LoadedModel",
    "RequestOptions",
    "SamplingParams",
    "StreamEvent",
    "load_target",
]
