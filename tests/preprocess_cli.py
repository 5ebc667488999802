"""`python -m megatron_mesh.preprocess` run in this process by the tests: its refusals."""
from __future__ import annotations

import pytest

from megatron_mesh.preprocess import main


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """What the command printed refusing `argv`: one line on stderr, exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err
