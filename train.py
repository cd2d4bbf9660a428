"""Train and evaluate: `python train.py +experiment=probe_smollm2` (see README.md)."""

import hydra
from omegaconf import DictConfig

from confrag.train import check_command_line, run_task


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_task(cfg)


if __name__ == "__main__":
    check_command_line()  # a key that moved is refused, naming its new place, before Hydra reads the command line
    main()
