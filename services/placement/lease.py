"""The leader lease: one placement replica issues commands, the others stand by.

`SET llmesh:placement:leader <id> NX PX <lease>` takes the lease; the holder extends it every third
of a lease with a compare-and-extend script, and a standby tries again as often (or as soon as the
holder's lease runs out, read with PTTL). The holder counts itself leader only until its last
successful renewal's send time plus the lease, less a margin: a holder that cannot reach Redis
(or is starved of CPU) stops before a standby can start, so two leaders never issue commands.
Without Redis the replica leads alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import redis.exceptions

log = logging.getLogger(__name__)

LEADER_KEY = "llmesh:placement:leader"
MARGIN = 0.1  # of a lease: how much earlier than Redis the holder gives up
# Extend the lease only while this replica still holds it.
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class LeaderLease:
    def __init__(
        self,
        redis_url: str,
        holder: str,
        lease_s: float,
        on_change: Callable[[bool], None] = lambda held: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.holder = holder
        self._lease_s = lease_s
        self._on_change = on_change
        self._clock = clock
        self._redis = (
            aioredis.Redis.from_url(redis_url, socket_timeout=lease_s / 3, socket_connect_timeout=lease_s / 3)
            if redis_url
            else None
        )
        self._renew = self._redis.register_script(_RENEW) if self._redis else None
        self._valid_until = math.inf if self._redis is None else 0.0
        self._mine = self._redis is None  # the last acquire or renewal succeeded
        self._reported = self._mine  # what `on_change` was last told
        if self._redis is None:
            log.info("no MESH_REDIS_URL: %s leads alone (run a single placement replica)", holder)

    @property
    def held(self) -> bool:
        """This replica may issue commands now."""
        return self._clock() < self._valid_until

    async def run(self) -> None:
        """Hold or wait for the lease until cancelled."""
        if self._redis is None:
            return
        while True:
            await asyncio.sleep(await self._attempt())

    async def _attempt(self) -> float:
        """One renewal (holder) or acquisition (standby); returns when to try next."""
        assert self._redis is not None and self._renew is not None
        period, lease_ms = self._lease_s / 3, int(self._lease_s * 1000)
        sent, wait = self._clock(), period
        try:
            if self._mine:
                self._mine = bool(await self._renew(keys=[LEADER_KEY], args=[self.holder, lease_ms]))
                if not self._mine:
                    log.warning("%s: the leader lease passed to another replica", self.holder)
            else:
                # a key still naming this replica (a renewal that timed out, e.g. starved of CPU) is
                # taken back at once, not after it expires
                self._mine = bool(await self._renew(keys=[LEADER_KEY], args=[self.holder, lease_ms])) or bool(
                    await self._redis.set(LEADER_KEY, self.holder, nx=True, px=lease_ms)
                )
                if not self._mine:
                    left_ms = await self._redis.pttl(LEADER_KEY)  # -2: gone meanwhile, -1: no expiry
                    wait = 0.0 if left_ms == -2 else min(period, left_ms / 1000 + 0.005) if left_ms >= 0 else period
        except (redis.exceptions.RedisError, OSError) as exc:
            if self._mine:
                log.warning("%s: cannot reach Redis to renew the leader lease (%s): standing by", self.holder, exc)
            self._mine = False
        self._valid_until = sent + self._lease_s * (1 - MARGIN) if self._mine else 0.0
        if self.held != self._reported:
            self._reported = self.held
            log.info("%s: %s", self.holder, "leading" if self.held else "standing by")
            self._on_change(self.held)
        return wait

    async def close(self) -> None:
        """Give the lease up (a standby takes over at its next try) and disconnect."""
        if self._redis is None:
            return
        held, self._valid_until = self._mine, 0.0
        try:
            if held:
                await self._redis.eval(_RELEASE, 1, LEADER_KEY, self.holder)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("%s: could not give the leader lease up: %s", self.holder, exc)
        finally:
            await self._redis.aclose()
