// A stand-in for libnccl.so.2 that records every call and moves no data (tests only).
//
// Loaded with LD_PRELOAD in front of the real library, it lets CuPy's real NCCL binding
// (cupy_backends.cuda.libs.nccl: its Cython argument conversion) run on a machine with no GPU,
// so that tests/test_real_nccl_binding.py can read the exact C arguments that gpucoll's NCCL
// backend makes CuPy pass: counts, datatype and op codes, roots, peers, stream handles.
//
// Every call appends one line to the file named by STUB_NCCL_LOG:
//   <call> comm=<pointer> key=value ... thread=<calling thread>
// Communicators are malloc'ed tokens; ncclCommGetAsyncError reports success.
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef void* ncclComm_t;
typedef void* cudaStream_t;

static void record(const char* format, ...) __attribute__((format(printf, 1, 2)));
static void record(const char* format, ...) {
  const char* path = getenv("STUB_NCCL_LOG");
  FILE* out = path ? fopen(path, "a") : stderr;
  if (!out) return;
  va_list args;
  va_start(args, format);
  vfprintf(out, format, args);
  va_end(args);
  fprintf(out, " thread=%lx\n", (unsigned long)pthread_self());
  if (out != stderr) fclose(out);
}

static ncclComm_t new_comm(void) { return malloc(16); }

int ncclGetVersion(int* version) { *version = 23203; return 0; }
const char* ncclGetErrorString(int result) { return "stub error"; }
int ncclGetUniqueId(ncclUniqueId* id) {
  for (int i = 0; i < 128; ++i) id->internal[i] = (char)(i * 37 + 11);
  return 0;
}
int ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, void* config) {
  unsigned sum = 0;
  for (int i = 0; i < 128; ++i) sum = sum * 31 + (unsigned char)id.internal[i];
  *comm = new_comm();
  record("init comm=%p nranks=%d rank=%d id=%08x", *comm, nranks, rank, sum);
  return 0;
}
int ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) { return 5; }
int ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* child, void* config) {
  *child = color == -1 ? NULL : new_comm();
  record("split comm=%p color=%d key=%d child=%p", comm, color, key, *child);
  return 0;
}
int ncclCommAbort(ncclComm_t comm) { record("abort comm=%p", comm); return 0; }
int ncclCommDestroy(ncclComm_t comm) { record("destroy comm=%p", comm); return 0; }
int ncclCommGetAsyncError(ncclComm_t comm, int* error) { *error = 0; return comm ? 0 : 4; }
int ncclCommCount(ncclComm_t comm, int* count) { *count = 0; return 0; }
int ncclCommCuDevice(ncclComm_t comm, int* device) { *device = 0; return 0; }
int ncclCommUserRank(ncclComm_t comm, int* rank) { *rank = 0; return 0; }
int ncclGroupStart(void) { record("groupStart"); return 0; }
int ncclGroupEnd(void) { record("groupEnd"); return 0; }
int ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op,
                  ncclComm_t comm, cudaStream_t stream) {
  record("allReduce comm=%p count=%zu datatype=%d op=%d inplace=%d stream=%p", comm, count,
         datatype, op, send == recv, stream);
  return 0;
}
int ncclReduce(const void* send, void* recv, size_t count, int datatype, int op, int root,
               ncclComm_t comm, cudaStream_t stream) {
  record("reduce comm=%p count=%zu datatype=%d op=%d root=%d stream=%p", comm, count, datatype,
         op, root, stream);
  return 0;
}
int ncclBroadcast(const void* send, void* recv, size_t count, int datatype, int root,
                  ncclComm_t comm, cudaStream_t stream) {
  record("broadcast comm=%p count=%zu datatype=%d root=%d inplace=%d stream=%p", comm, count,
         datatype, root, send == recv, stream);
  return 0;
}
int ncclBcast(void* buff, size_t count, int datatype, int root, ncclComm_t comm,
              cudaStream_t stream) {
  record("bcast comm=%p count=%zu", comm, count);
  return 0;
}
int ncclAllGather(const void* send, void* recv, size_t count, int datatype, ncclComm_t comm,
                  cudaStream_t stream) {
  record("allGather comm=%p count=%zu datatype=%d stream=%p", comm, count, datatype, stream);
  return 0;
}
int ncclReduceScatter(const void* send, void* recv, size_t count, int datatype, int op,
                      ncclComm_t comm, cudaStream_t stream) {
  record("reduceScatter comm=%p count=%zu datatype=%d op=%d stream=%p", comm, count, datatype,
         op, stream);
  return 0;
}
int ncclSend(const void* send, size_t count, int datatype, int peer, ncclComm_t comm,
             cudaStream_t stream) {
  record("send comm=%p count=%zu datatype=%d peer=%d stream=%p", comm, count, datatype, peer,
         stream);
  return 0;
}
int ncclRecv(void* recv, size_t count, int datatype, int peer, ncclComm_t comm,
             cudaStream_t stream) {
  record("recv comm=%p count=%zu datatype=%d peer=%d stream=%p", comm, count, datatype, peer,
         stream);
  return 0;
}
