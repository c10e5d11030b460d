"""The monitoring record's score histogram: the same counts as np.histogram over the fixed bins."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.scorer import SCORE_BINS, score_histogram

edges = st.sampled_from([float(b) for b in SCORE_BINS])
scores = st.one_of(st.floats(-0.5, 1.5, allow_nan=False), edges, st.floats(0.0, 1.0))


@given(st.lists(scores, min_size=1, max_size=200))
def test_counts_match_numpys_histogram_edges_and_out_of_range_included(values: list[float]) -> None:
    array = np.array(values)
    assert score_histogram(array) == np.histogram(array, SCORE_BINS)[0].tolist()


def test_one_lands_in_the_last_bin_and_each_edge_opens_its_bin() -> None:
    assert score_histogram(np.array([1.0, 0.0, 0.1, 0.9999])) == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
