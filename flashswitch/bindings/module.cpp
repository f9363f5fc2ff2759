// The extension module flashswitch._C. Importing it runs the static torch.library registrations of
// every bindings/<op>.cpp linked into it (ops under torch.ops.flashswitch_C); the module itself is empty.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "flashswitch CUDA kernels; the ops live in torch.ops.flashswitch_C",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
