"""confrag's Hydra configs. This folder is shipped as the package `confrag.conf` (pyproject.toml's
package-dir), so that an installed confrag finds them (confrag.infra.paths.config_dir); Hydra reads only the YAML."""
