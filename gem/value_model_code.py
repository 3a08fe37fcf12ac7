"""The code MLflow runs to build a packaged value model (models from code; see :mod:`gem.packaging`).

Logged as the model's code file in place of a pickled ``python_model``: loading the model imports this,
and the model reads its weights (safetensors) and config (JSON) in ``load_context``.
"""

from mlflow.models import set_model

from gem.packaging import GemValueModel

set_model(GemValueModel())
