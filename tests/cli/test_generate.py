"""``kvtier generate``: a second run of the same session resumes it from the embedded
server's data directory (window rebuilt by replay after the restart) and continues it
exactly as a process that never stopped would."""

from __future__ import annotations

import pytest

from model.checkpoint import save
from services import cli
from services.cli.generate import continue_greedy
from tests.support.replay import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def generate(capsys, weights, data_dir, session, prompt, n=6) -> tuple[int, str, str]:
    code = cli.main(["generate", "--session", session, "--prompt", prompt, "--weights",
                     str(weights), "--data-dir", str(data_dir), "--max-new-tokens", str(n)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_runs_resume_the_session_and_continue_it(model, tmp_path, capsys):
    weights = tmp_path / "tiny.safetensors"
    save(model, weights)
    data = tmp_path / "data"
    code, first, err = generate(capsys, weights, data, "chat", "import os\n")
    assert code == 0 and "new session default/chat" in err
    code, second, err = generate(capsys, weights, data, "chat", "def main():")
    assert code == 0
    # 10 prompt bytes + 6 generated: the restart dropped the window; replay rebuilt it
    assert "resumed default/chat: 16 tokens" in err and "window rebuilt by replaying" in err
    # the same two turns in one process that never spilled anything
    state, out1 = continue_greedy(model, None, b"import os\n", 6)
    _, out2 = continue_greedy(model, state, b"def main():", 6)
    assert first == bytes(out1).decode("utf-8", errors="replace") + "\n"
    assert second == bytes(out2).decode("utf-8", errors="replace") + "\n"
    # another session is independent
    code, _, err = generate(capsys, weights, data, "other", "x", n=1)
    assert code == 0 and "new session default/other" in err


def test_bad_arguments_are_refused(model, tmp_path, capsys):
    code, _, err = generate(capsys, tmp_path / "missing.safetensors", tmp_path, "s", "hi")
    assert code == 1 and "no weights at" in err
    code, _, err = generate(capsys, tmp_path / "missing.safetensors", tmp_path, "s", "hi", -1)
    assert code == 2 and "must be >= 0" in err
