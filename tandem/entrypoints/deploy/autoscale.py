"""When a role of a deployment grows or shrinks (``--autoscale``): a decision from what the
routers see, with hysteresis so that a burst does not flap replicas in and out.

Per role, every supervisor tick:

    load       = legs in flight on the role's serving replicas / their number
    overloaded = load > scale_out_in_flight, or (prefill and colocated roles) the routers' recent
                 mean time to first event > ttft_target (when given)
    idle       = load < scale_in_in_flight and not overloaded

A role grows by one replica once it has been overloaded for ``scale_out_after`` s, and shrinks by
one once it has been idle for ``scale_in_after`` s, within [minimum, maximum]. Any change
restarts both clocks, so the next one waits for fresh evidence (the cooldown). The two
thresholds leave a band in which nothing changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.validation import require

TTFT_ROLES = ("prefill", "colocated")  # the roles whose work the time to first token waits on


@dataclass(frozen=True)
class AutoscaleConfig:
    scale_out_in_flight: float = 4.0
    scale_in_in_flight: float = 1.0
    ttft_target: Optional[float] = None  # seconds
    scale_out_after: float = 5.0
    scale_in_after: float = 30.0

    def __post_init__(self) -> None:
        require(self.scale_in_in_flight < self.scale_out_in_flight, "scale_in_in_flight",
                f"must be below scale_out_in_flight ({self.scale_out_in_flight}), got {self.scale_in_in_flight}")
        require(self.scale_in_in_flight >= 0, "scale_in_in_flight", f"must be >= 0, got {self.scale_in_in_flight}")
        for name in ("scale_out_after", "scale_in_after"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(self.ttft_target is None or self.ttft_target > 0, "ttft_target",
                f"must be > 0, got {self.ttft_target}")


@dataclass
class RoleClock:
    overloaded_since: Optional[float] = None
    idle_since: Optional[float] = None


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig
    clocks: dict[str, RoleClock] = field(default_factory=dict)

    def desired(self, role: str, replicas: int, minimum: int, maximum: int, in_flight: int,
                first_event_seconds: Optional[float], now: float) -> int:
        """How many serving replicas ``role`` should have, given ``replicas`` now."""
        clock = self.clocks.setdefault(role, RoleClock())
        load = in_flight / max(replicas, 1)
        slow = (self.config.ttft_target is not None and role in TTFT_ROLES and first_event_seconds is not None
                and first_event_seconds > self.config.ttft_target)
        overloaded = load > self.config.scale_out_in_flight or slow
        idle = load < self.config.scale_in_in_flight and not overloaded
        clock.overloaded_since = (clock.overloaded_since or now) if overloaded else None
        clock.idle_since = (clock.idle_since or now) if idle else None
        target = min(max(replicas, minimum), maximum)
        if target != replicas:
            pass
        elif overloaded and now - clock.overloaded_since >= self.config.scale_out_after and replicas < maximum:
            target = replicas + 1
        elif idle and now - clock.idle_since >= self.config.scale_in_after and replicas > minimum:
            target = replicas - 1
        if target != replicas:
            self.clocks[role] = RoleClock()
        return target
