"""benchmarks/gpu_session.sh on a host without a GPU: a step's seconds, the bundle that comes back."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_a_step_prints_its_seconds_and_the_bundle_holds_the_session(tmp_path):
    session, out = tmp_path / "session", tmp_path / "out"
    env = {**os.environ, "INSTALL": "0", "QUICK": "1", "STEPS": "headline", "FILTER": "rms_norm/scale/",
           "SESSION_DIR": str(session), "OUT": str(out), "PYTHON": sys.executable,
           "PALLAS_KERNELS_COMMIT": "", "COMMIT": "abc1234"}
    proc = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== headline (at most 170 s" in proc.stdout
    steps = (out / "steps.txt").read_text()
    assert "== headline: exit 0 after" in steps and "steps: headline=0;" in steps
    assert "commit: abc1234" in (session / "env.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["session.tar.gz", "steps.txt"]  # 8 files at most come back
    with tarfile.open(out / "session.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./env.txt", "./steps.txt", "./headline.txt", "./bench/results.json"} <= names
