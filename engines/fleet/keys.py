"""The fleet's Redis keys, named in one place: every key of one fleet lies under
``fleet:<FLEET_NAME>:`` (one Redis may hold several fleets).

* ``cards``: a hash, server id -> its ``membership.ServerCard`` as JSON;
* ``beats``: a sorted set, server id -> its last heartbeat on the Redis server's clock (``TIME``);
* ``left``: a hash, server id -> when it stopped on purpose;
* ``rows``: a hash, server id -> its ``rows.ServerRows`` as JSON (and the channel they are
  published on);
* ``foreign``: a hash, attached server id -> its last poll's ``ServerRows``;
* ``lease:<what>``: the member doing a job for the whole fleet;
* ``control:<server>``: a list, the control commands other members sent that server.

Every key expires: the shared ones a while (``FLEET_KEY_TTL_S``) after the last member's last
beat, leases when their holder stops renewing them, a control queue a minute after its last
command.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FleetKeys"]


@dataclass(frozen=True)
class FleetKeys:
    """The keys of fleet ``fleet`` in its Redis."""

    fleet: str

    @property
    def base(self) -> str:
        return f"fleet:{self.fleet}:"

    @property
    def cards(self) -> str:
        return self.base + "cards"

    @property
    def beats(self) -> str:
        return self.base + "beats"

    @property
    def left(self) -> str:
        return self.base + "left"

    @property
    def rows(self) -> str:
        return self.base + "rows"

    @property
    def foreign(self) -> str:
        return self.base + "foreign"

    def shared(self) -> tuple[str, ...]:
        """The keys every member writes, whose expiry each beat pushes back (leases and control
        queues expire on their own)."""
        return self.cards, self.beats, self.left, self.rows, self.foreign

    def lease(self, what: str) -> str:
        return self.base + "lease:" + what

    def control(self, server: str) -> str:
        return self.base + "control:" + server
