"""Shared fixtures of the sampling tests: one fresh tiny engine per family and test module."""
import pytest

from leandiffusion.tests.kit import tiny_engine


@pytest.fixture(scope="module")
def sd1():
    return tiny_engine("sd1")


@pytest.fixture(scope="module")
def sdxl():
    return tiny_engine("sdxl")
