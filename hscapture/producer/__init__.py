"""The engine side: what runs inside the engine process.

:class:`EngineProducer` is the one engine-facing API every engine integration calls
(:mod:`hscapture.producer.base` says who calls what, and how often); :class:`Producer` implements it
over a ring and a socket pair, :class:`NullProducer` does nothing. Rows then flow producer -> ring
(:mod:`hscapture.ring`) -> consumer (:mod:`hscapture.consumer`) -> store (:mod:`hscapture.store`).
"""

from hscapture.producer.base import EngineProducer, NullProducer, ProducerCounters, WrittenStep, device_index
from hscapture.producer.producer import RUN_STEPS, Producer

__all__ = ["RUN_STEPS", "EngineProducer", "NullProducer", "Producer", "ProducerCounters", "WrittenStep", "device_index"]
