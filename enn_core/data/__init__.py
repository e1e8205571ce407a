"""stage-data and the staged dataset format (docs/design.md).

Entry points: `staging.run` (the stage), `staging.stage_features` (features-only data for
predict), `dataset.StagedDataset` (the read-only view later stages use), `demo.stage_synthetic`
(a small staged dataset for tests). Submodules are imported explicitly, so a reader of staged
data does not pull in the input parsers.
"""
