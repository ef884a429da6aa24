import types

from herald.loader.demo import run_demo


def test_run_demo(capsys):
    assert run_demo(types.SimpleNamespace(rows=20000, batch_size=1024, shuffle_buffer=2048)) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "20,000 samples" in out
