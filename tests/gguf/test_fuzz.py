"""Mutated tiny files: every outcome is a valid parse or ggufcheck's own error."""

from ggufcheck.testing.fuzz import fuzz


def test_mutations_parse_or_fail_cleanly(tmp_path):
    counts, crashes = fuzz(cases=400, seed=1234, workdir=tmp_path)
    assert not crashes, crashes[:3]
    # the fuzzer must actually exercise both outcomes, or it tests nothing
    assert counts["parsed"] > 0 and counts["rejected"] > 0, counts
