"""Wire drafting methods (what the scheduler asks for) -> the engine's `DraftMethod`."""

from __future__ import annotations

from shared.engine.drafting import DraftMethod
from shared.wire import BeamMethod, ChainMethod, DynamicTreeMethod, StaticTreeMethod
from shared.wire import DraftMethod as WireMethod


def engine_method(method: WireMethod, batch_size: int = 1) -> DraftMethod:
    """The dynamic tree's node limit is per request; its budget spans the whole batch."""
    match method:
        case ChainMethod(length=length):
            return DraftMethod("chain", k=length)
        case StaticTreeMethod(expansion=expansion):
            return DraftMethod("static", expansion=tuple(expansion))
        case BeamMethod(depth=depth, width=width):
            return DraftMethod("beam", depth=depth, width=width)
        case DynamicTreeMethod(max_nodes=nodes, max_depth=depth, max_width=width):
            return DraftMethod(
                "dynamic",
                budget=nodes * max(batch_size, 1),
                max_size=nodes,
                max_depth=depth,
                max_width=width,
            )
    raise TypeError(f"unknown drafting method {method!r}")
