"""`bench soak` on real ranks: jobs of every plan with cancels and aborted sessions mixed in, each result equal to
its configuration's first run, no restart, and the engine's files, shared memory, descriptors and threads flat;
nothing left after close. Run through the command line in process (its exit status and its JSON rows)."""
import json

from engine.cli import main


def test_a_short_soak_matches_every_reference_through_cancels_and_aborts_and_leaves_counts_flat(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = main(["bench", "--json", str(out), "soak", "--jobs", "24"])
    printed = capsys.readouterr()
    print(printed.out[-4000:], printed.err[-2000:])
    assert code == 0, printed.err
    assert "verdict: PASS" in printed.out and "| engine dir files" in printed.out
    s = json.loads(out.read_text())["soak"][0]
    soak, warm = s["counts"], s["warmup_counts"]
    print("soak:", soak, "warm-up:", warm, "before:", s["before"], "after:", s["after"])
    assert soak["jobs"] == 24 and soak["generate"] and soak["echo"] and soak["model sessions"]
    for counts in (soak, warm):   # every complete run compared (first runs set the references) and equal
        assert counts["mismatches"] == 0 and counts["matched"] == counts["compared"]
        assert counts["cancels asked"] == counts["cancelled"] + counts["finished before the cancel landed"]
    assert soak["compared"] >= 18
    # cancels raised JobCancelled (only those are counted), at more than one step; sessions aborted by an exception
    assert soak["cancelled"] + warm["cancelled"] >= 4
    assert len(set(soak["cancelled at step"]) | set(warm["cancelled at step"])) >= 2
    assert soak["sessions aborted"] + warm["sessions aborted"] >= 1
    assert soak["matched right after an interrupt"] >= 3   # the job after an interrupt still equals its reference
    assert s["max_abs_diff"] == 0.0
    assert s["restarts"] == []
    assert s["after"]["counts"] == s["before"]["counts"]   # files, own engine dirs, fds of every process, threads
    assert s["alive_after_close"] == [] and s["engine_dir_left"] is False
