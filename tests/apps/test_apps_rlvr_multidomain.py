"""The shipped multi-domain config (apps/rlvr/configs/rlvr_cpu_multidomain.yaml) with the demo's data: math, code and
multiple-choice prompts in every batch by domain_interleave_probs, each domain's records routed to its reward. (A
multi-domain pipeline run with per-domain metrics and timeline tracks: tests/apps/test_apps_rlvr_roll_file_runs.py.)
"""

from __future__ import annotations

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.demo_multidomain import CONFIG, DOMAINS, records
from apps.rlvr.domains import DomainSampler, domain_probs
from apps.rlvr.preflight import preflight
from apps.rlvr.rewards import RewardRouter


def test_the_demo_config_mixes_its_three_domains_in_every_batch(tmp_path):
    paths = [f"pretrain={tmp_path}", f"actor_train.data_args.file_name={tmp_path}"]
    config = RLVRConfig.from_dict(load_config(CONFIG, paths))
    preflight(config)
    probs = domain_probs(config)
    assert probs == {"math_rule": 0.5, "code_sandbox": 0.25, "crossthinkqa": 0.25}
    rows = records()
    router = RewardRouter(config.rewards)
    domains = [router.section_for(row) for row in rows]
    assert [DOMAINS[row["tag"]] for row in rows] == domains  # every record goes to the reward of its tag
    indices, _ = DomainSampler(probs, domains, seed=config.seed).draw(config.rollout_batch_size)
    assert [domains[i] for i in indices] == ["math_rule"] * 8 + ["code_sandbox"] * 4 + ["crossthinkqa"] * 4
