"""ROLL's multi-domain batches: ``actor_train.data_args.domain_interleave_probs`` gives each domain (a reward
section's name) its share of every batch of prompts.

A record's domain is its ``domain`` column, else the reward section its ``tag`` goes to (ROLL's ``tag_2_domain``).
Each step draws ``int(p * count)`` prompts of every domain but the last, which takes the rest, each domain from its
own shuffled stream (seeded per domain, reshuffled per epoch of that domain); the batch lists the domains in the
order of ``domain_interleave_probs``, as ROLL concatenates its per-domain batches. Records of domains without a
share are never drawn, as ROLL drops them. Without ``domain_interleave_probs`` one stream serves every record.
"""

from __future__ import annotations

from typing import Any

from apps.common.sampler_state import SamplerState
from apps.rlvr.data import DataError, PromptSampler

KEY = "actor_train.data_args.domain_interleave_probs"


def domain_probs(config: Any) -> dict[str, float] | None:
    """``domain_interleave_probs`` checked against the reward sections (None when unset).

    Raises ``ValueError`` naming the key when it is not a mapping of reward section names to probabilities in
    (0, 1], or when the shares of ``rollout_batch_size`` they give are not all at least one prompt.
    """
    probs = config.actor_train.data_args.get("domain_interleave_probs")
    if probs is None:
        return None
    if not isinstance(probs, dict) or not probs:
        raise ValueError(f"{KEY} must map reward section names to probabilities, got {probs!r}")
    for domain, p in probs.items():
        if domain not in config.rewards:
            raise ValueError(
                f"{KEY} names domain {domain!r}, which is no reward section; domains are reward sections: "
                f"{sorted(config.rewards)}."
            )
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"{KEY}.{domain} must be a probability in (0, 1], got {p!r}")
    filters = [n for n, s in config.rewards.items() if (s.spec.query_filter_config or {}).get("type", "no_filter")
               not in (None, "no_filter")]  # fmt: skip
    if filters or config.is_use_additional_prompts:
        why = f"rewards.{filters[0]}.query_filter_config" if filters else "is_use_additional_prompts"
        raise ValueError(
            f"{KEY} with dynamic sampling ({why}) is not supported: refills would not keep each domain's share "
            "(ROLL fills a quota per domain); drop one of them."
        )
    shares = domain_shares({d: float(p) for d, p in probs.items()}, config.rollout_batch_size)
    if min(shares.values()) < 1:
        raise ValueError(
            f"{KEY} gives {shares} of rollout_batch_size={config.rollout_batch_size} prompts (int(p x batch), the "
            "last domain the rest): every domain needs at least one; raise its probability or the batch size."
        )
    return {d: float(p) for d, p in probs.items()}


def domain_shares(probs: dict[str, float], count: int) -> dict[str, int]:
    """ROLL's split of ``count`` prompts: ``int(p * count)`` for each domain but the last, which takes the rest."""
    names = list(probs)
    shares = {name: int(probs[name] * count) for name in names[:-1]}
    shares[names[-1]] = count - sum(shares.values())
    return shares


class DomainSampler:
    """One ``PromptSampler`` per domain, drawn from in ``domain_shares``; ``state`` is a ``SamplerState`` whose
    ``streams`` hold each domain's ``[epoch, position]`` (what a checkpoint records)."""

    def __init__(self, probs: dict[str, float], domains: list[str], seed: int) -> None:
        self.probs = probs
        self.members = {name: [i for i, d in enumerate(domains) if d == name] for name in probs}
        for name, members in self.members.items():
            if not members:
                raise DataError(f"{KEY} names domain {name!r}, but no training record belongs to it (its tags).")
        self.samplers = {
            name: PromptSampler(len(m), seed + 7919 * k) for k, (name, m) in enumerate(self.members.items())
        }

    @property
    def state(self) -> SamplerState:
        """A snapshot of every domain's position."""
        streams = {name: [s.state.epoch, s.state.position] for name, s in self.samplers.items()}
        return SamplerState(streams=streams)

    @state.setter
    def state(self, state: SamplerState) -> None:
        if set(state.streams) != set(self.samplers):
            raise DataError(
                f"the checkpoint's sampler holds domains {sorted(state.streams)}, this config's {KEY} "
                f"{sorted(self.samplers)}: resume with the domains the run started with."
            )
        for name, (epoch, position) in state.streams.items():
            self.samplers[name].state = SamplerState(epoch, position)

    def draw(self, count: int) -> tuple[list[int], list[str]]:
        """``count`` record indices, domain by domain, and a group id for each (domain, its epoch, record)."""
        indices, uids = [], []
        for name, share in domain_shares(self.probs, count).items():
            local, local_uids = self.samplers[name].draw(share)  # "<epoch>:<index in the domain>"
            indices += [self.members[name][i] for i in local]
            uids += [f"{name}:{uid.split(':')[0]}:{self.members[name][i]}" for i, uid in zip(local, local_uids)]
        return indices, uids
