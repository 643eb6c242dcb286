"""The consumer side: the process that drains the ring into the store.

:class:`Consumer` attaches to a producer, copies announced slots out of the ring
(:mod:`hscapture.ring`), releases them and writes the rows to the store (:mod:`hscapture.store`);
:mod:`hscapture.consumer.metrics` shows how it keeps up.
"""

from hscapture.consumer.consumer import Consumer, ConsumerStats, consume_command

__all__ = ["Consumer", "ConsumerStats", "consume_command"]
