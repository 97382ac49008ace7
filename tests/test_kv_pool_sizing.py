"""How many KV pages an engine takes on a device with memory statistics (a GPU): from
kv_cache_memory_fraction of what the weights left, or from vLLM's gpu_memory_utilization."""
import argparse

import pytest

from jlight import engine_args
from jlight.engine.engine_config import EngineConfig
from jlight.engine.startup import pages_for_memory

GIB = 2 ** 30
STATS = {"bytes_limit": 100 * GIB, "bytes_in_use": 20 * GIB}  # 20 GiB of weights loaded
PAGE = 2 * 2 ** 20  # 2 MiB a page


def test_kv_cache_memory_fraction_takes_a_share_of_what_is_left():
    assert pages_for_memory(STATS, PAGE, 0.8, None) == int(80 * GIB * 0.8) // PAGE


def test_gpu_memory_utilization_is_the_engines_whole_share():
    # vLLM's meaning: 0.9 of the memory for everything, the weights' 20 GiB included -> 70 GiB of pages.
    assert pages_for_memory(STATS, PAGE, 0.8, 0.9) == 70 * GIB // PAGE
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.15 allows 15.00 GiB, but the weights already use 20.00 GiB"):
        pages_for_memory(STATS, PAGE, 0.8, 0.15)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization.*must be in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=value).validate()


def test_the_cli_passes_gpu_memory_utilization():
    parser = argparse.ArgumentParser()
    engine_args.add_engine_arguments(parser)
    assert engine_args.engine_options(parser.parse_args(["--gpu-memory-utilization", "0.9"]))["gpu_memory_utilization"] == 0.9
