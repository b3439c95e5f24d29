"""Kombu's Redis transport, made to survive a Redis restart in a worker that runs tasks with acks_late.

When the broker connection drops, the worker closes it and reconnects. Closing a channel puts its
unacknowledged messages back (restore_unacked), which needs a Redis client; kombu 5.7 builds one from
`self.connection.client`, which is already None at that point, and the AttributeError it raises is
not one of the connection errors the worker ignores while closing: the worker logs "Unrecoverable
error: AttributeError('NoneType' object has no attribute 'hostname')" and stops consuming
(tests/test_redis_outage_e2e.py; bench/reliability.py R3). Here that case is a connection error,
which the worker ignores as it does every other error of a dead connection, and then reconnects.
Nothing is lost by not restoring on close: the Redis transport restores unacknowledged messages past
their visibility timeout, and UGRO's tasks are idempotent and re-queued by beat every few seconds.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False):
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("the broker connection is already closed")
        return super()._connparams(asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel
