"""benchmarks/llama_mtp.py's reading of llama-speculative-simple (a report captured from its real run on the demo,
draft-mtp K 3): the decode speed, drafts and tokens per verify step it prints; the generated text after the echoed
prompt; and bad flags refused in one line before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from llama_mtp import common_prefix, generated_text, parse_spec  # noqa: E402

REPORT = """0.00.030.563 I common_speculative_init_result: creating MTP draft context against the target model 'demo-mtp-f32.gguf'
0.00.213.715 I encoded   12 tokens in    0.009 seconds, speed: 1366.898 t/s
0.00.213.716 I decoded  131 tokens in    0.168 seconds, speed:  782.066 t/s
0.00.213.717 I 
0.00.213.717 I n_draft   = 3
0.00.213.717 I n_predict = 131
0.00.213.717 I n_drafted = 127
0.00.213.718 I n_accept  = 88
0.00.213.718 I accept    = 69.291%
"""


def test_the_report_gives_speed_drafts_and_tokens_per_step():
    r = parse_spec(REPORT)
    assert (r["decoded"], r["drafted"], r["accepted"]) == (131, 127, 88)
    assert r["tokens_per_second"] == pytest.approx(131 / 0.168)
    assert r["tokens_per_step"] == pytest.approx(131 / (131 - 88))  # each step: its accepted drafts and one token


def test_a_report_without_its_lines_is_one_error():
    with pytest.raises(ValueError, match="printed no decoded, drafted, accepted line"):
        parse_spec("error: failed to initialize speculative decoding\n")


def test_the_generated_text_follows_the_echoed_prompt():
    prompt = "def read_lines(path):"
    assert generated_text("\n\ndef read_lines(path):\n    lines = []\n", prompt) == "\n    lines = []\n"
    with pytest.raises(ValueError, match="does not echo the prompt"):
        generated_text("something else", prompt)
    assert common_prefix("abcd", "abxd") == 2 and common_prefix("abc", "abcdef") == 3


@pytest.mark.parametrize("args, message", [
    (["--llama-bin", "/nonexistent/llama-speculative-simple"], "--llama-bin /nonexistent/llama-speculative-simple: no such file"),
    (["--llama-bin", sys.executable, "--nextn", "4"], "--nextn takes 1 to 3"),
])
def test_bad_flags_are_one_line(args, message):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llama_mtp.py"), "--llama-python", sys.executable,
                        *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
