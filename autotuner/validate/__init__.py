"""The predictor checked against the real thing: the layout's whole GPTModel trained for a few steps,
timed and metered (:mod:`~autotuner.validate.steps`), and the prediction compared with them
(:mod:`~autotuner.validate.validate`). autotuner.predict is a model and never imports this package; this
package runs Megatron-Core and torch to measure what the model predicts.
"""
