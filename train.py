"""Train and evaluate: `python train.py +experiment=probe_smollm2` (see README.md)."""

import sys

import hydra
from omegaconf import DictConfig

from confrag.instantiators import grouped_overrides
from confrag.train import run_task


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_task(cfg)


if __name__ == "__main__":
    sys.argv[1:] = grouped_overrides(sys.argv[1:])  # old probe-data keys, read for one release
    main()
