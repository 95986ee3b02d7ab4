from typing import ClassVar, Literal

from pydantic import Field, model_validator

from llmesh.wire.config import CommonSettings, ModelSettings, ScalingSettings


class PlacementSettings(ModelSettings, ScalingSettings, CommonSettings):
    """Named `placement_*`: `make run` gives every service the same environment (the kv-store
    reads MESH_METRICS_PORT, for one). Freeness is Llumnix's: free KV blocks per request in the
    batch (llmesh.policies.llumnix.freeness)."""

    NATS_USER: ClassVar[str] = "placement"

    placement_id: str = Field(
        "", description="This replica's name (the leader lease holds it); default: placement-<host>-<pid>."
    )
    placement_period_s: float = Field(
        0.5, gt=0, description="How often the leader looks at the heartbeats and issues migrations."
    )
    placement_lease_s: float = Field(
        2.0,
        gt=0,
        description="Leader lease in Redis (`MESH_REDIS_URL`), renewed every third of it; a standby "
        "takes over about this long after the leader dies. Without Redis the replica leads alone.",
    )
    placement_balance: bool = Field(
        True,
        description="Migrate requests from the least free decode workers to "
        "the freest (Llumnix's load balancing); drains migrate regardless.",
    )
    placement_source_below: float = Field(
        10.0,
        description="A decode worker whose freeness is below this gives up a request: its requests can "
        "grow by only about this many blocks each before it runs out of KV and preempts.",
    )
    placement_destination_above: float = Field(
        30.0,
        description="... to one whose freeness is above this: the gap between the two keeps a move from "
        "making the destination the next source.",
    )
    placement_priority_headroom_blocks: int = Field(
        0,
        ge=0,
        description="Blocks counted beside each high-priority request (priority < 0) in freeness, as the "
        "router's llumnix policy does.",
    )
    placement_cooldown_s: float = Field(
        5.0,
        ge=0,
        description="A request moved (or refused) for balance is not moved again for this long (no ping-pong).",
    )
    placement_migrate_timeout_s: float = Field(
        15.0, gt=0, description="How long a migration's hand-shake may take before it counts as failed."
    )
    placement_scale_low: float = Field(
        10.0,
        description="Scaling advice: average freeness of the active decode workers below this asks for one more (+1).",
    )
    placement_scale_high: float = Field(60.0, description="... above this, one of them can go (-1).")
    placement_roles: bool = Field(
        True,
        description="Switch workers built with both roles between the prefill and decode pools when their "
        "loads part (BanaServe's adaptive module migration, llmesh.policies.banaserve.pick_role_switch); the "
        "pools' loads are their mean utilisation U = C/Cmax + M/Mmax.",
    )
    placement_role_threshold: float = Field(
        0.3, ge=0, description="Role switching: the pools' mean utilisations differ by more than this (δ) ..."
    )
    placement_role_hold_s: float = Field(3.0, ge=0, description="... for this long, in the same direction ...")
    placement_role_cooldown_s: float = Field(
        15.0,
        ge=0,
        description="... and no switch came this soon before "
        "(anti-oscillation; it also gives a switched worker's heartbeats "
        "time to show its new load).",
    )
    placement_role_min_ratio: float = Field(
        1.0,
        ge=0,
        description="Switch only when the imbalance removed is at least this many times the switch's cost (ρ).",
    )
    placement_role_switch_cost: float = Field(
        0.1, ge=0, description="The cost of a switch, in utilisation units (a worker's U lies in 0-2) ..."
    )
    placement_role_request_cost: float = Field(
        0.05,
        ge=0,
        description="... plus this per request the switched worker holds (they finish in its old role first).",
    )
    placement_role_backlog_s: float = Field(
        1.0,
        ge=0,
        description="A prefill worker with this many seconds of queued prompt tokens at its measured "
        "speed counts as fully busy, if its requests do not say more; 0: requests only.",
    )
    placement_role_timeout_s: float = Field(
        10.0, gt=0, description="How long a worker may take to answer a role switch before it counts as failed."
    )
    placement_role_policy: Literal["pools", "devices"] = Field(
        "pools",
        description="How role switching weighs loads: 'pools', the pools' mean U, one switch at a time (the "
        "placement_role_* knobs above); 'devices', BanaServe's Algorithm 4-1 per device "
        "(llmesh.policies.banaserve.plan_module_migrations: pairs of workers by U, KV moves between decode "
        "workers and role switches while a pair stays apart, each worth its cost in seconds; the "
        "placement_modules_* knobs; placement_role_backlog_s applies to both).",
    )
    placement_modules_start_gap: float = Field(
        0.4, ge=0, description="Devices: migrating starts once two workers' U differ by more than this (δ↑) ..."
    )
    placement_modules_stop_gap: float = Field(
        0.2, ge=0, description="... and goes on, period after period, while two differ by more than this (δ↓)."
    )
    placement_modules_min_ratio: float = Field(
        0.5, ge=0, description="Devices: a move must remove at least this much peak U per second of its cost (ρ)."
    )
    placement_modules_block_s: float = Field(
        0.001, ge=0, description="Devices: the cost of one KV block moved between workers, in seconds ..."
    )
    placement_modules_sync_s: float = Field(
        0.03, ge=0, description="... plus this per request moved (its pause while its last KV and state move) ..."
    )
    placement_modules_switch_s: float = Field(
        1.0, ge=0, description="... or this per role switch, beyond the KV of the requests it hands over."
    )
    placement_modules_budget_s: float = Field(
        2.0, ge=0, description="Devices: one period's moves cost at most this together."
    )
    placement_models: bool = Field(
        True,
        description="Place the catalogue's models on the hosts whose host agents report (Prism): activate a model "
        "that requests wait for where KV pressure is lowest, evict idle ones to make room (llmesh_placement.models). "
        "Without a host agent it does nothing.",
    )
    placement_slo_ms: float = Field(
        1000.0,
        gt=0,
        description="The time-to-first-token target of a model whose catalogue entry sets none, in its weight "
        "(request rate over target) for placement.",
    )
    placement_idle_s: float = Field(
        120.0,
        ge=0,
        description="A model without requests for this long may be evicted when its host is short of memory.",
    )
    placement_move_threshold: float = Field(
        0.1,
        ge=0,
        description="Algorithm 1 moves a running model to another host only when that lowers its KV pressure by more "
        "than this (Prism's τ; requests/s per SLO second per GiB left for KV): it is activated there, then its "
        "workers on the old host are drained.",
    )
    placement_move_cooldown_s: float = Field(
        60.0, ge=0, description="A model moved is not moved again for this long (no back and forth on noisy rates)."
    )
    placement_activate_timeout_s: float = Field(
        180.0, gt=0, description="An activated worker that sends no heartbeat within this is asked for again."
    )
    placement_scale_window_s: float = Field(
        10.0, ge=0, description="How long the advice must hold, since it changed and since the last action, to act."
    )
    placement_scale_down_window_s: float = Field(
        60.0,
        ge=0,
        description="... and to drain an instance, at least as long: a lull between bursts is no reason to drain "
        "what the next burst needs (scale-down stabilisation).",
    )
    placement_metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    placement_metrics_port: int = Field(
        0,
        ge=0,
        description="Serve Prometheus /metrics on this port; 0: no HTTP "
        "endpoint (decisions are counted in `status` too).",
    )

    @model_validator(mode="after")
    def _bands_are_ordered(self) -> "PlacementSettings":
        if self.placement_source_below > self.placement_destination_above:
            raise ValueError("placement_source_below must not exceed placement_destination_above")
        if self.placement_scale_low > self.placement_scale_high:
            raise ValueError("placement_scale_low must not exceed placement_scale_high")
        if self.placement_modules_stop_gap > self.placement_modules_start_gap:
            raise ValueError("placement_modules_stop_gap must not exceed placement_modules_start_gap")
        if self.placement_min_decode_workers > self.placement_max_decode_workers:
            raise ValueError("placement_min_decode_workers must not exceed placement_max_decode_workers")
        return self
