"""tools/plot_metrics.py draws every run of each metric family into a PNG."""

from __future__ import annotations

import importlib.util
import json

from launch import REPO

spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "tools" / "plot_metrics.py")
plot_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_metrics)


EVAL = {
    "eval/avg@1": 0.5,
    "eval/pass@1": 0.5,
    "eval/reward_mean": 0.7,
    "eval/aime24/avg@4": 0.2,
    "eval/aime24/pass@4": 0.4,
    "eval/aime24/maj@4": 0.3,
    "eval/aime24/problems": 30,
}


def write_run(path, scale):
    path.mkdir()
    with (path / "metrics.jsonl").open("w") as f:
        for step in range(1, 21):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "reward/mean": scale * step / 20,
                        "actor/clip_fraction": 0.1,
                        "response/length_mean": 4.0,
                        "moe/route_change_fraction": 0.05,
                        "env/tool_call_rate": step / 20,
                        "critic/explained_variance": 1 - 1 / step,
                        "mismatch/k3_kl": 1e-3 * step,
                        "moe/route_flips": 0.1,
                        "moe/route_flips/layer_0": 0.05,
                        "moe/route_flips/layer_1": 0.15,
                        "actor/clip_fraction_lag_0": 0.1,
                        "actor/clip_fraction_length_q4": 0.2,
                        "stability/reward_ema": scale * step / 25,
                        **({"stability/rolled_back_from": 12.0} if step == 11 else {}),
                        **(EVAL if step % 10 == 0 else {}),
                    }
                )
                + "\n"
            )


def test_overlays_runs_into_pngs(tmp_path):
    write_run(tmp_path / "a", 1.0)
    write_run(tmp_path / "b", 0.5)
    out = tmp_path / "plots"
    assert (
        plot_metrics.main(
            [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--smooth", "3"]
        )
        == 0
    )
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "clip_by_lag.png", "clip_by_length.png", "clip_fraction.png", "critic.png",
        "episodes.png", "eval.png", "mismatch.png", "response_length.png", "reward.png",
        "route_change.png", "route_flips.png", "sentinel.png",
    ]  # fmt: skip
    assert plot_metrics._expand("moe/route_flips/layer_", {"moe/route_flips/layer_10", "a",
                                "moe/route_flips/layer_2"}) == [
        "moe/route_flips/layer_2", "moe/route_flips/layer_10",
    ]  # fmt: skip
    # the evaluation figure: every benchmark's avg@n and pass@k
    assert [k for k in EVAL if plot_metrics._is_benchmark_accuracy(k)] == [
        "eval/avg@1", "eval/pass@1", "eval/aime24/avg@4", "eval/aime24/pass@4",
    ]  # fmt: skip
    assert all((out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert plot_metrics.main([str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
