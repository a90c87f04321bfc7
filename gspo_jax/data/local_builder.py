"""What every locally made TFDS builder here shares (arithmetic, scratchpad, GSM8K): no
download lines, text features, and (for the generated ones) test-first splits.

A mixin, not a `GeneratorBasedBuilder` subclass, so TFDS does not register it as a dataset:
`class SyntheticX(LocalBuilder, tfds.core.GeneratorBasedBuilder)`."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow_datasets as tfds


class LocalBuilder:
    """Mixin of the builders that read or generate their data locally."""

    # TFDS would print "Downloading and preparing dataset ..." and "... downloaded and
    # prepared", though nothing is downloaded: build_dataset logs its own line instead.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    def _text_info(self, description: str, fields: Sequence[str], **kwargs):
        """DatasetInfo of records whose every field is text."""
        return tfds.core.DatasetInfo(
            builder=self,
            description=description,
            features=tfds.features.FeaturesDict({f: tfds.features.Text() for f in fields}),
            supervised_keys=None,
            **kwargs,
        )

    def _test_first(self, problems: Sequence[dict], num_test: int) -> dict:
        """Split generators of generated problems: the first `num_test` are the test split."""
        return {
            "train": self._generate_examples("train", problems[num_test:]),
            "test": self._generate_examples("test", problems[:num_test]),
        }

    def _generate_examples(self, split: str, problems):
        for i, problem in enumerate(problems):
            example_id = f"{split}-{i:05d}"
            yield example_id, {"id": example_id, **problem}
