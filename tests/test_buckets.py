"""The one padding rule (`bipace_jax.buckets.Buckets`), on hand-computed cases."""

import pytest

from bipace_jax.buckets import Buckets


def test_fit_takes_the_first_size_that_holds_n_else_the_largest():
    b = Buckets((8, 16, 32), "sampler.batch_buckets")
    assert [b.fit(n) for n in (0, 1, 8, 9, 16, 17, 32, 33, 100)] == [8, 8, 8, 16, 16, 32, 32, 32, 32]


def test_fit_rounds_up_to_the_row_shards():
    b = Buckets((8, 12, 32))
    assert b.fit(9, multiple=8) == 16  # 12 rounded up to 2 x 8
    assert b.fit(1, multiple=3) == 9
    assert b.fit(33, multiple=5) == 35


def test_fit_or_raise_names_the_field():
    b = Buckets((512, 1024), "sampler.length_buckets")
    assert b.fit_or_raise(513) == 1024
    with pytest.raises(ValueError, match=r"1025 exceeds the largest sampler.length_buckets entry 1024"):
        b.fit_or_raise(1025)


def test_fit_within_caps_at_the_given_width():
    b = Buckets((16, 64, 256))
    assert b.fit_within(0, 512) == 16
    assert b.fit_within(17, 512) == 64
    assert b.fit_within(17, 40) == 40
    assert b.fit_within(300, 400) == 400


@pytest.mark.parametrize("sizes", [(), (0, 4), (8, 8), (16, 8)])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="name_of_field"):
        Buckets(sizes, "name_of_field")
