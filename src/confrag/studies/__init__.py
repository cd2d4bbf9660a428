"""Studies of the LLM's likelihood as a reranker's teacher: the questions, folds and rows a study compares.

`likelihood_study` holds what every such study shares (its questions, dev and test split, BM25 candidates, the
cached ℓ, the base's vectors, cross-fitted folds, answers through the cache); `frozen_precheck` asks whether frozen
features can predict ℓ's choice; `fair_student` trains the students of the fair-student design and
`fair_report` writes its table. The scripts in `experiments/` are their command lines.
"""
