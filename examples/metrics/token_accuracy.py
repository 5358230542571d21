"""Token accuracy: an `evaluate` metric module kept as a local file.

`evaluate.load` accepts a path to a local script like this one, which works offline (the
`evaluate` package ships no metrics itself; named metrics such as "accuracy" are fetched from
the Hub). Load it with

    metric = evaluate.load("examples/metrics/token_accuracy.py")
    metric.compute(predictions=[5, 7, 9], references=[5, 8, -100])   # {'token_accuracy': 0.5}

Predictions and references are flat sequences of token ids; a reference equal to `ignore_index`
(-100, the label of padding and of prompt tokens in SFT) is not counted.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = (
    "Fraction of predicted token ids equal to the reference token ids, ignoring references equal to ignore_index."
)

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted token ids (argmax of the logits, shifted to line up with the labels).
    references (`list` of `int`): reference token ids (the labels).
    ignore_index (`int`, default -100): references equal to this value are not counted.
Returns:
    token_accuracy (`float`): correct / counted, 0.0 when nothing is counted.
    counted_tokens (`int`): how many tokens were counted.
Examples:
    >>> metric = evaluate.load("examples/metrics/token_accuracy.py")
    >>> metric.compute(predictions=[5, 7, 9], references=[5, 8, -100])
    {'token_accuracy': 0.5, 'counted_tokens': 2}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokenAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, ignore_index=-100):
        predictions, references = np.asarray(predictions), np.asarray(references)
        counted = references != ignore_index
        n = int(counted.sum())
        correct = int((predictions[counted] == references[counted]).sum())
        return {"token_accuracy": correct / n if n else 0.0, "counted_tokens": n}
