"""PaddleBackend (ops/_backend.py) keeps core/backend.py's contract: views without copies, and the
Linear GEMMs in Paddle's [in, out] weight layout against paddle's own autograd of x @ W."""

import paddle

from paddle_fastffn.ops._backend import PaddleBackend
from tolerances import assert_close


def test_views_share_memory_and_shapes_read_as_tuples():
    be = PaddleBackend()
    x = paddle.randn([2, 3, 8])
    rows, viewed = be.rows(x), be.reshape(x, [2, 3, 2, 4])
    assert be.shape(x) == (2, 3, 8) and be.shape(rows) == (6, 8) and be.shape(viewed) == (2, 3, 2, 4)
    assert rows.data_ptr() == x.data_ptr() == viewed.data_ptr()
    assert be.contiguous(x) is x
    assert be.detach(x).stop_gradient and be.detach(x).data_ptr() == x.data_ptr()


def test_linear_and_its_gradients_match_paddle_autograd():
    be = PaddleBackend()
    x = paddle.randn([2, 5, 7])
    weight = paddle.randn([7, 3])  # Paddle's Linear layout: [in, out]
    dy = paddle.randn([2, 5, 3])
    x_ref, w_ref = x.clone(), weight.clone()
    x_ref.stop_gradient = w_ref.stop_gradient = False
    y_ref = paddle.matmul(x_ref, w_ref)
    y_ref.backward(dy)
    assert_close(be.linear(x, weight), y_ref, paddle.float32, "linear")
    assert_close(be.linear_grad_input(dy, weight), x_ref.grad, paddle.float32, "linear_grad_input")
    assert_close(be.linear_grad_weight(x, dy), w_ref.grad, paddle.float32, "linear_grad_weight", reduced_rows=10)
