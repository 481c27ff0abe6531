"""Reading config files as YAML, refusing a key given twice in one mapping (a module of its
own so that a job reading its sealed resolved config never imports yaml; eaglepipe.core.config)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A config file names one key twice in one mapping (`_UniqueKeyLoader`)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice: the plain loader keeps
    the last one, and a second `train:` section would silently drop the first one's settings."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges are meant to be overridden
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"key {key} appears twice in one mapping (lines {seen[key]} and {line}): "
                    "YAML keeps only the last, and the settings under the first would be lost; "
                    "merge them into one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_config_yaml(path: str | os.PathLike):
    """A config file's YAML (JSON is YAML too); a key given twice in one mapping is an error."""
    return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)
