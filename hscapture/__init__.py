"""hscapture: per-layer hidden states out of a live LLM engine at almost no cost to serving."""

from hscapture.config import CaptureConfig, ConsumerConfig
from hscapture.errors import CreditTimeout, HSCaptureError, ProtocolError, StoreError
from hscapture.producer import NullProducer, Producer, ProducerCounters
from hscapture.reader import Store, open_store

__all__ = [
    "CaptureConfig",
    "ConsumerConfig",
    "CreditTimeout",
    "HSCaptureError",
    "NullProducer",
    "Producer",
    "ProducerCounters",
    "ProtocolError",
    "Store",
    "StoreError",
    "open_store",
]
__version__ = "0.1.0"
