"""The speculative decoding engine: the only package of specwise that imports torch.

`load_target` reads weights, `make_drafter` builds a drafter from a spec string, and `Engine` runs the shared
draft-and-verify loop (a baseline is simply an engine without a drafter).
"""

from specwise.engine.engine import Engine, GenerationResult, StreamEvent
from specwise.engine.sampling import SamplingParams
from specwise.engine.weights import LoadedModel, load_target

__all__ = ["Engine", "GenerationResult", "LoadedModel", "SamplingParams", "StreamEvent", "load_target"]
