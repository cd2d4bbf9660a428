"""Train and evaluate: `python train.py +experiment=probe_smollm2` (see README.md)."""

import hydra
from omegaconf import DictConfig

from confrag.train import rewrite_command_line, run_task


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_task(cfg)


if __name__ == "__main__":
    rewrite_command_line()  # the probe data node's old flat keys, read for one release
    main()
