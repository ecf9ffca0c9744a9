//===- Export.h - symbol visibility of the public API -------------*- C++
//-*-===//
#ifndef DUALKV_EXPORT_H
#define DUALKV_EXPORT_H

/// Everything in libdualkv.so is hidden except what carries DUALKV_API.
#define DUALKV_API __attribute__((visibility("default")))

#endif
