"""predict: chunked, resumable, multi-worker inference in real units.

`enn_core.predict.stage.run(cfg, ctx)` is the stage; `enn_core.predict.flow_steps` holds the
functions the prediction flow calls.
"""
