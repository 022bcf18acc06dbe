"""The vectorized MNIST-1D generator gives the ``mnist1d`` package's data."""

import numpy as np
import pytest

from flashsgd.train.data.mnist1d import generate_mnist1d, load_mnist1d


@pytest.mark.parametrize("num_samples,seed", [(1000, 42), (730, 3)])
def test_generator_equals_the_package(num_samples, seed):
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    state = np.random.get_state()
    try:
        ref = make_dataset(args)
    finally:
        np.random.set_state(state)
    ours = generate_mnist1d(num_samples, seed)
    for got, key in zip(ours, ("x", "y", "x_test", "y_test")):
        assert got.shape == ref[key].shape and got.dtype.kind == ref[key].dtype.kind, key
        if key.startswith("y"):
            np.testing.assert_array_equal(got, ref[key])
        else:  # round-off order of the filter and the interpolation: at most an ulp of float64
            np.testing.assert_allclose(got, ref[key], rtol=0, atol=1e-13)
            np.testing.assert_array_equal(got.astype(np.float32), ref[key].astype(np.float32))


def test_generator_leaves_global_rngs_alone(tmp_path):
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    load_mnist1d(num_samples=100, seed=9, cache_dir_=tmp_path)
    np.testing.assert_array_equal(np.random.rand(3), expected)
