"""The engine side: what runs inside the engine process.

:class:`Producer` is the engine-neutral API every engine hook calls (copy a step's rows into the
ring, announce them); :mod:`hscapture.producer.graph` writes into the ring from inside a CUDA
graph. Rows then flow producer -> ring (:mod:`hscapture.ring`) -> consumer
(:mod:`hscapture.consumer`) -> store (:mod:`hscapture.store`).
"""

from hscapture.producer.producer import NullProducer, Producer, ProducerCounters, WrittenStep

__all__ = ["NullProducer", "Producer", "ProducerCounters", "WrittenStep"]
