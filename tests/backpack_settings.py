"""Convolution settings of BackPACK's own test suite, transcribed as data.

Sources (BackPACK's repository, not installed with the package):
- ``test/extensions/firstorder/firstorder_settings.py``: the conv cases of
  ``make_simple_cnn_setting(input_size, conv_cls, conv_params)``, i.e.
  ``Sequential(conv(*conv_params), ReLU(), Flatten(), Linear(out_dim, 5))`` with
  cross-entropy on 5 classes; ``conv_params`` are positional
  ``(C_in, C_out, k, stride, padding, dilation, groups, bias)``;
- ``test/core/derivatives/convolution_settings.py``: ``CONVOLUTION_SETTINGS`` (the
  convolutions, and the transposed ones in ``DERIVATIVES_CONV_TRANSPOSE``) and
  ``CONVOLUTION_FAIL_SETTINGS`` (the grouped ones) for Conv1d/2d/3d, as keyword
  arguments and input shapes.
"""

# (input shape, dims, positional conv params)
FIRSTORDER_CONV = [
    ((3, 3, 7), 1, (3, 2, 2)),
    ((3, 2, 7), 1, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 7), 1, (3, 2, 2, 2, 1)),
    ((3, 3, 8), 1, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 7), 1, (3, 2, 2, 4, 2, 1, 1, False)),
    ((3, 3, 7, 7), 2, (3, 2, 2)),
    ((3, 2, 7, 7), 2, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 7, 7), 2, (3, 2, 2, 2, 1)),
    ((3, 3, 8, 8), 2, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 7, 7), 2, (3, 2, 2, 4, 2, 1, 1, False)),
    ((3, 3, 2, 7, 7), 3, (3, 2, 2)),
    ((3, 2, 3, 7, 7), 3, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 2, 7, 7), 3, (3, 2, 2, 3, 2)),
    ((3, 3, 4, 8, 8), 3, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 2, 7, 7), 3, (3, 2, 2, 4, 2, 1, 1, False)),
]

# (input shape, dims, keyword conv params)
DERIVATIVES_CONV = [
    ((3, 4, 7, 7), 2, dict(in_channels=4, out_channels=6, kernel_size=2)),
    (
        (3, 3, 7),
        1,
        dict(in_channels=3, out_channels=9, kernel_size=2, padding=1, bias=False, groups=3),
    ),
    (
        (3, 6, 7),
        1,
        dict(in_channels=6, out_channels=9, kernel_size=2, padding=1, bias=False, groups=3),
    ),
    (
        (3, 4, 7),
        1,
        dict(in_channels=4, out_channels=8, kernel_size=2, padding=1, bias=False, groups=4),
    ),
    ((3, 2, 7), 1, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1, bias=False)),
    (
        (1, 3, 8),
        1,
        dict(in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4, dilation=3),
    ),
    (
        (1, 3, 8),
        1,
        dict(
            in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4, dilation=3, groups=3
        ),
    ),
    ((3, 2, 11), 1, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    ((3, 2, 7, 7), 2, dict(in_channels=2, out_channels=4, kernel_size=2, padding=1, groups=2)),
    ((3, 4, 7, 7), 2, dict(in_channels=4, out_channels=4, kernel_size=2, padding=1, groups=2)),
    ((3, 6, 7, 7), 2, dict(in_channels=6, out_channels=9, kernel_size=2, padding=1, groups=3)),
    ((3, 4, 7, 7), 2, dict(in_channels=4, out_channels=12, kernel_size=2, padding=1, groups=4)),
    (
        (1, 2, 8, 8),
        2,
        dict(
            in_channels=2, out_channels=4, kernel_size=2, padding=2, stride=4, dilation=3, groups=2
        ),
    ),
    (
        (1, 3, 8, 8),
        2,
        dict(
            in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4, dilation=3, groups=3
        ),
    ),
    ((3, 2, 7, 7), 2, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    ((3, 2, 5, 7, 7), 3, dict(in_channels=2, out_channels=4, kernel_size=2, groups=2)),
    ((3, 3, 5, 7, 7), 3, dict(in_channels=3, out_channels=6, kernel_size=2, groups=3)),
    (
        (3, 2, 5, 7, 7),
        3,
        dict(
            in_channels=2,
            out_channels=3,
            kernel_size=2,
            padding=2,
            bias=False,
            dilation=2,
            stride=2,
        ),
    ),
    ((1, 3, 3, 4, 4), 3, dict(in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4)),
    ((3, 2, 3, 7, 7), 3, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    # non-default hyper-parameters
    ((3, 2, 7), 1, dict(in_channels=2, out_channels=3, kernel_size=2, dilation=2)),
    ((3, 2, 7, 7), 2, dict(in_channels=2, out_channels=3, kernel_size=2, dilation=2)),
    ((3, 2, 3, 7, 7), 3, dict(in_channels=2, out_channels=3, kernel_size=2, dilation=2)),
    # grouped (BackPACK's CONVOLUTION_FAIL_SETTINGS for its Hessian tests)
    ((3, 4, 7), 1, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
    ((3, 4, 7, 7), 2, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
    ((3, 4, 3, 7, 7), 3, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
    ((3, 6, 7), 1, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
    ((3, 6, 7, 7), 2, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
    ((3, 6, 3, 7, 7), 3, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
]

# transposed convolutions: CONVOLUTION_SETTINGS' ConvTranspose entries and
# CONVOLUTION_TRANSPOSED_FAIL_SETTINGS (grouped) of the same file
# (input shape, dims, keyword conv params)
DERIVATIVES_CONV_TRANSPOSE = [
    ((3, 2, 7), 1, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1, bias=False)),
    (
        (1, 3, 8),
        1,
        dict(in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4, dilation=3),
    ),
    ((3, 2, 11), 1, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    (
        (3, 2, 7, 7),
        2,
        dict(
            in_channels=2,
            out_channels=3,
            kernel_size=2,
            bias=False,
            padding=1,
            stride=2,
            dilation=2,
        ),
    ),
    (
        (1, 3, 8, 8),
        2,
        dict(in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4, dilation=3),
    ),
    ((3, 2, 7, 7), 2, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    (
        (3, 2, 5, 7, 7),
        3,
        dict(
            in_channels=2,
            out_channels=3,
            kernel_size=2,
            padding=2,
            bias=False,
            dilation=2,
            stride=2,
        ),
    ),
    ((1, 3, 3, 4, 4), 3, dict(in_channels=3, out_channels=6, kernel_size=2, padding=2, stride=4)),
    ((3, 2, 3, 7, 7), 3, dict(in_channels=2, out_channels=3, kernel_size=2, padding=1)),
    # non-default hyper-parameters
    ((3, 2, 20), 1, dict(in_channels=2, out_channels=3, kernel_size=2, stride=3, dilation=5)),
    ((3, 2, 9, 9), 2, dict(in_channels=2, out_channels=4, kernel_size=2, dilation=2)),
    ((3, 2, 9, 9, 9), 3, dict(in_channels=2, out_channels=4, kernel_size=2, dilation=2)),
    # grouped
    ((3, 6, 7), 1, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
    ((3, 6, 7, 7), 2, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
    ((3, 6, 3, 7, 7), 3, dict(in_channels=6, out_channels=9, kernel_size=2, dilation=2, groups=3)),
    ((3, 4, 7), 1, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
    ((3, 4, 7, 7), 2, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
    ((3, 4, 3, 7, 7), 3, dict(in_channels=4, out_channels=6, kernel_size=2, dilation=2, groups=2)),
]
