"""Output-length prediction for predictive routers (GoodServe's MoE-MLP, a history
baseline). Importing this package does not import torch: only training and loading the
MoE model do (``skymesh.predict.moe``)."""
