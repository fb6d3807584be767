"""An optimizer written apart from gpucoll's, and the data every rank slices its batches from,
for the sharded-training tests' expected values."""

import numpy as np

SETTINGS = {"sgd": dict(lr=0.1, momentum=0.9), "adam": dict(lr=0.01)}


class ReferenceOptimizer:
    """Per-array NumPy SGD-momentum / Adam in float64 arithmetic: the independent answer."""

    def __init__(self, name, params):
        self.name, self.settings, self.t = name, SETTINGS[name], 0
        self.m = [np.zeros(p.shape) for p in params]
        self.v = [np.zeros(p.shape) for p in params]

    def step(self, params, grads):
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v):
            g = g.astype(np.float64)
            if self.name == "sgd":
                m[...] = self.settings["momentum"] * m + g
                p -= (self.settings["lr"] * m).astype(p.dtype)
            else:
                m[...] = 0.9 * m + 0.1 * g
                v[...] = 0.999 * v + 0.001 * g * g
                m_hat, v_hat = m / (1 - 0.9 ** self.t), v / (1 - 0.999 ** self.t)
                p -= (self.settings["lr"] * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(p.dtype)


def training_data(sizes, steps, global_batch):
    """``steps`` global batches of inputs (``sizes[0]`` features) and labels (``sizes[-1]``
    classes), the same on every rank."""
    rng = np.random.default_rng(11)
    n = steps * global_batch
    return rng.standard_normal((n, sizes[0])).astype(np.float32), rng.integers(0, sizes[-1], n)


def rank_batch(x, y, step, rank, size, global_batch):
    """Rank ``rank``'s equal share of global batch ``step`` (the whole batch for size 1)."""
    local = global_batch // size
    lo = step * global_batch + rank * local
    return x[lo:lo + local], y[lo:lo + local]


def one_process_training(optimizer, sizes, data, steps, global_batch, max_norm=None):
    """The digits MLP (``sizes``, seed 5) trained in one process on the whole of each global
    batch of ``data``, its gradients clipped in float64 to ``max_norm`` (as torch's
    ``clip_grad_norm_``) when given: the parameters and each step's gradient norm."""
    from gpucoll.examples.train_digits import init_params, loss_and_grads

    x, y = data
    params = init_params(sizes, seed=5)
    opt = ReferenceOptimizer(optimizer, params)
    norms = []
    for step in range(steps):
        _, _, grads = loss_and_grads(params, *rank_batch(x, y, step, 0, 1, global_batch))
        grads = [g.astype(np.float64) for g in grads]
        norm = np.sqrt(sum(float((g * g).sum()) for g in grads))
        coef = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
        opt.step(params, [g * coef for g in grads])
        norms.append(norm)
    return params, norms
