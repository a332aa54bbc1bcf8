"""ROLL's per-role policy-loss keys of ``actor_train`` and how they pick the rl-core loss.

ROLL's ``actor_train.worker_cls`` names the worker class: ``ActorWorker`` (the default) trains PPO, on a token or a
sequence ratio (``importance_sampling: token`` / ``seq``); ``ActorPGWorker`` trains the off-policy loss its
``actor_train.pg_variant`` names, with the knobs it reads from the role (``tis_*``, ``topr_*``, ``cispo_*``,
``kimi15_tau``). ROLL reads ``actor_train.pg_variant`` only in ``ActorPGWorker``, so it is refused with any other
worker (rather than silently ignored); the top-level ``pg_variant`` (rl-core's names, as verl's ``loss_mode``) picks
the loss of ``ActorWorker`` runs. The knobs apply to whichever loss reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from rl_core.losses import PolicyLossConfig

ACTOR_WORKERS = ("ActorWorker", "ActorPGWorker")
"""ROLL's actor worker classes (the last component of ``actor_train.worker_cls``)."""
ROLL_PG_VARIANTS = {"vanilla": "gpg", "ppo": "vanilla", "tis": "tis", "topr": "topr", "cispo": "cispo",
                    "kimi15": "kimi15"}  # fmt: skip
"""``ActorPGWorker``'s ``pg_variant`` -> rl-core loss: its ``vanilla`` is the plain policy gradient ``-A log pi``
(rl-core's ``gpg``), its ``ppo`` rl-core's clipped PPO (``vanilla``)."""
IMPORTANCE_SAMPLING = {"token": "vanilla", "seq": "sequence_ppo"}
"""``ActorWorker``'s PPO by ``importance_sampling``."""
RATIO_TYPES = ("token", "segment")
"""ROLL's agentic ``ratio_type``: PPO on a token ratio, or on one ratio per segment (an assistant turn)."""
AGENTIC_PG_WORKER = "agentic_actor_pg_worker.ActorWorker"
"""ROLL's agentic ActorPGWorker keeps the class name ActorWorker in its own module."""


@dataclass
class ActorPolicyArgs:
    """The policy-loss keys of the ``actor_train`` section (ROLL's WorkerConfig fields of ActorPGWorker); the loss
    knobs are rl-core ``PolicyLossConfig`` fields of the same names, whose defaults they take."""

    worker_cls: str | None = None
    """ROLL worker class: ``...actor_worker.ActorWorker`` (PPO; default) or ``...actor_pg_worker.ActorPGWorker``."""
    pg_variant: str | None = None
    """ActorPGWorker's loss: vanilla (-A log pi), ppo, tis, topr, cispo, kimi15."""
    tis_lower_bound: float = PolicyLossConfig.tis_lower_bound
    """TIS: lower truncation of the detached ratio."""
    tis_upper_bound: float = PolicyLossConfig.tis_upper_bound
    """TIS: upper truncation of the detached ratio."""
    topr_positive_weight: float = PolicyLossConfig.topr_positive_weight
    """TOPR: weight of the SFT-like term on positive-reward sequences."""
    topr_negative_weight: float = PolicyLossConfig.topr_negative_weight
    """TOPR: weight of the truncated IS term on the other sequences."""
    cispo_epsilon_low: float = PolicyLossConfig.cispo_epsilon_low
    """CISPO: ratio clipped below 1 - epsilon_low."""
    cispo_epsilon_high: float = PolicyLossConfig.cispo_epsilon_high
    """CISPO: ratio clipped above 1 + epsilon_high."""
    cispo_use_unified_mask: bool = PolicyLossConfig.cispo_use_unified_mask
    """CISPO: drop the tokens PPO would clip."""
    kimi15_tau: float = PolicyLossConfig.kimi15_tau
    """Kimi k1.5: weight of the squared log-ratio regulariser."""

    def loss_knobs(self) -> dict[str, Any]:
        """The rl-core ``PolicyLossConfig`` fields set here (every key but worker_cls and pg_variant; the same
        names and, unset, the same defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("worker_cls", "pg_variant")}

    @property
    def worker(self) -> str:
        """The worker class's last component (``ActorWorker`` when unset); ``ActorPGWorker`` for ROLL's agentic one
        (``roll.pipeline.agentic.agentic_actor_pg_worker.ActorWorker``)."""
        if (self.worker_cls or "").endswith(AGENTIC_PG_WORKER):
            return "ActorPGWorker"
        return (self.worker_cls or "ActorWorker").rsplit(".", 1)[-1]


POLICY_KEYS = frozenset(f.name for f in fields(ActorPolicyArgs))


def pop_policy_args(section: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the policy keys of an ``actor_train`` mapping (the rest is its WorkerConfig)."""
    return {key: section.pop(key) for key in list(section) if key in POLICY_KEYS}


def policy_loss_name(config: Any, ratio_type: str = "token") -> str:
    """The rl-core loss a config trains with; raises ``ValueError`` naming the keys when they disagree.
    ``ratio_type`` (ROLL's agentic key): ``segment`` trains PPO on one ratio per segment (``segment_ppo``)."""
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"ratio_type={ratio_type!r}; valid values: {list(RATIO_TYPES)}.")
    loss = _token_ratio_loss(config)
    if ratio_type == "token":
        return loss
    if loss not in ("vanilla", "ppo") or config.importance_sampling != "token":
        raise ValueError(
            f"ratio_type: segment is ROLL's PPO on one ratio per segment (an assistant turn), but the configured loss "
            f"is {loss!r} (pg_variant / actor_train.pg_variant / importance_sampling); the segment ratio is built "
            "for PPO here: use pg_variant ppo (vanilla with ActorWorker), or ratio_type: token."
        )
    return "segment_ppo"


def _token_ratio_loss(config: Any) -> str:
    """The loss ``worker_cls``, the pg_variants and ``importance_sampling`` pick (on a token or sequence ratio)."""
    args: ActorPolicyArgs = config.actor_policy
    if args.worker not in ACTOR_WORKERS:
        raise ValueError(
            f"actor_train.worker_cls={args.worker_cls!r} is not one of ROLL's actor workers {list(ACTOR_WORKERS)} "
            "(roll.pipeline.rlvr.actor_worker.ActorWorker or roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker)."
        )
    if args.worker == "ActorWorker":
        if args.pg_variant is not None:
            raise ValueError(
                f"actor_train.pg_variant={args.pg_variant!r} is read only by ROLL's ActorPGWorker; set "
                "actor_train.worker_cls: roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker, or choose the loss with "
                "the top-level pg_variant."
            )
        if config.importance_sampling not in IMPORTANCE_SAMPLING:
            raise ValueError(f"importance_sampling must be 'token' or 'seq', got {config.importance_sampling!r}")
        if config.importance_sampling == "seq":
            if config.pg_variant not in ("vanilla", "ppo"):
                raise ValueError(
                    f"importance_sampling: seq is ROLL's PPO on a sequence ratio, but pg_variant is "
                    f"{config.pg_variant!r}; use pg_variant: vanilla (or gspo for the GSPO-token form)."
                )
            return IMPORTANCE_SAMPLING["seq"]
        return str(config.pg_variant)
    variant = args.pg_variant or "vanilla"
    if variant not in ROLL_PG_VARIANTS:
        raise ValueError(f"actor_train.pg_variant={variant!r} is not one of ActorPGWorker's {list(ROLL_PG_VARIANTS)}")
    if config.importance_sampling != "token":
        raise ValueError("importance_sampling: seq applies to ROLL's ActorWorker PPO; ActorPGWorker's losses use the "
                         "token ratio. Drop importance_sampling or the ActorPGWorker worker_cls.")  # fmt: skip
    loss = ROLL_PG_VARIANTS[variant]
    if config.pg_variant not in ("vanilla", loss) and ROLL_PG_VARIANTS.get(config.pg_variant) != loss:
        raise ValueError(
            f"pg_variant={config.pg_variant!r} and actor_train.pg_variant={variant!r} (ActorPGWorker) name different "
            "losses; the role's decides with ActorPGWorker: make them agree or drop the top-level one."
        )
    return loss
