"""The scaling policy file (schemas/policy.py): TOML in, validated, flags on top; bad
policies refused with the reason; the learning-rate ramp."""

from __future__ import annotations

import subprocess
import sys

import pytest

from schemas.batching import lr_factor_at
from schemas.policy import ScalingPolicy, load_policy
from harness import REPO

GOOD = """
min_replicas = 2
max_replicas = 8
replica_discrete_values = [2, 4, 8]
scale_up_snooze_s = 5
lr_warmup_steps = 4
[per_scale.2]
lr_factor = 0.5
"""


def test_toml_policy_with_flag_overrides(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(GOOD)
    p = load_policy(f, scale_up_snooze_s=0, max_replicas=None)
    assert p.sizes() == [2, 4, 8] and p.scale_up_snooze_s == 0 and p.max_replicas == 8
    assert p.lr_factor(2) == 0.5 and p.lr_factor(4) == 1.0
    assert load_policy(None) == ScalingPolicy()


@pytest.mark.parametrize("text, why", [
    ("min_replicas = 4\nmax_replicas = 2", "min_replicas (4) > max_replicas (2)"),
    ("replica_discrete_values = [2, 3]\nreplica_increment_step = 2", "not both"),
    ("replica_discrete_values = [4, 2]", "strictly increasing"),
    ("replicas = 3", "Extra inputs are not permitted"),
    ("min_replicas = [", "not valid TOML"),
])
def test_bad_policy_refused_with_reason(tmp_path, text, why):
    f = tmp_path / "p.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_policy(f)


def test_up_refuses_a_bad_policy_before_starting_anything(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text("max_replicas = 2")
    r = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--workers", "3",
                        "--policy", str(f), "--run-dir", str(tmp_path / "run")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--workers 3 exceeds max_replicas 2" in r.stderr
    assert not (tmp_path / "run").exists()


def test_lr_ramp():
    assert [lr_factor_at(s, 10, 1.0, 0.5, 4) for s in range(10, 15)] == \
        [0.875, 0.75, 0.625, 0.5, 0.5]
    assert lr_factor_at(3, 0, 1.0, 2.0, 0) == 2.0
