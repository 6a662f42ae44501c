// The main() of a host-compiled kernel program (flashlab/hostcuda, program()): it reads launches from a job file,
// runs them, and writes each launch's output buffers to the output file as soon as that launch returns, so that
// what finished before a crash or a timeout can still be read back.
//
// Usage: PROGRAM JOBS OUT. JOBS, all integers little-endian:
//   "HCJ1", u32 buffer count, per buffer: u8 output flag, u64 size in bytes, the bytes;
//   u32 launch count, per launch: u32 name length, the name, u32 gx, gy, gz, bx, u32 argument count, per argument:
//   u8 kind ('b' u32 buffer index, 'i' i32, 'f' f32, 'l' i64).
// OUT receives, per launch in order, the bytes of the output buffers it names, in argument order.
// The kernels' own printing goes nowhere (stdout is /dev/null); messages of this program go to stderr.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace hostcuda_driver {

[[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "hostcuda: %s\n", what);
    std::exit(3);
}

struct Reader {
    std::FILE* f;
    template <class T>
    T get() {
        T x;
        if (std::fread(&x, sizeof x, 1, f) != 1) fail("job file truncated");
        return x;
    }
};

struct Arg {
    char kind;
    unsigned buffer;
    long long value;  // i32, f32 (bits) or i64
    void* slot;       // what the kernel's parameter is read from
};

}  // namespace hostcuda_driver

int main(int argc, char** argv) {
    using namespace hostcuda_driver;
    if (argc != 3) fail("usage: PROGRAM JOBS OUT");
    std::FILE* in = std::fopen(argv[1], "rb");
    if (!in) fail("cannot open the job file");
    Reader r{in};
    char magic[4];
    if (std::fread(magic, 1, 4, in) != 4 || std::memcmp(magic, "HCJ1", 4) != 0) fail("not a job file");
    const unsigned nbuf = r.get<unsigned>();
    std::vector<std::vector<unsigned char>> buffers(nbuf);
    std::vector<unsigned char> is_output(nbuf);
    for (unsigned b = 0; b < nbuf; ++b) {
        is_output[b] = r.get<unsigned char>();
        const unsigned long long size = r.get<unsigned long long>();
        buffers[b].resize(size);
        if (size && std::fread(buffers[b].data(), 1, size, in) != size) fail("job file truncated");
    }
    std::vector<unsigned long long> sizes(nbuf);
    for (unsigned b = 0; b < nbuf; ++b) sizes[b] = buffers[b].size();
    std::FILE* out = std::fopen(argv[2], "wb");
    if (!out) fail("cannot open the output file");
    if (!std::freopen("/dev/null", "w", stdout)) fail("cannot silence stdout");
    const unsigned nlaunch = r.get<unsigned>();
    for (unsigned l = 0; l < nlaunch; ++l) {
        const unsigned len = r.get<unsigned>();
        if (len > 256) fail("kernel name too long");
        std::string name(len, '\0');
        if (len && std::fread(name.data(), 1, len, in) != len) fail("job file truncated");
        const unsigned gx = r.get<unsigned>(), gy = r.get<unsigned>(), gz = r.get<unsigned>(),
                       bx = r.get<unsigned>();
        const unsigned nargs = r.get<unsigned>();
        if (nargs > 64) fail("too many kernel arguments");
        std::vector<Arg> args(nargs);
        std::vector<void*> pointers(nargs);
        std::vector<void*> slots(nargs);
        for (unsigned a = 0; a < nargs; ++a) {
            Arg& x = args[a];
            x.kind = (char)r.get<unsigned char>();
            if (x.kind == 'b') {
                x.buffer = r.get<unsigned>();
                if (x.buffer >= nbuf) fail("bad buffer index");
                pointers[a] = buffers[x.buffer].data();
                slots[a] = &pointers[a];
            } else if (x.kind == 'i') {
                x.value = r.get<int>();
                slots[a] = &x.value;  // little-endian: the low 4 bytes are the int32
            } else if (x.kind == 'f') {
                x.value = r.get<unsigned>();
                slots[a] = &x.value;
            } else if (x.kind == 'l') {
                x.value = r.get<long long>();
                slots[a] = &x.value;
            } else {
                fail("bad argument kind");
            }
        }
        const HostcudaEntry* entry = nullptr;
        for (const HostcudaEntry& e : hostcuda_kernels)
            if (name == e.name) entry = &e;
        if (!entry) fail(("no kernel named " + name).c_str());
        if (entry->arity != nargs) fail(("wrong number of arguments for " + name).c_str());
        if (bx == 0 || bx > 1024 || gx == 0 || gy == 0 || gz == 0) fail("bad launch shape");
        entry->launch(gx, gy, gz, bx, slots.data());
        for (unsigned a = 0; a < nargs; ++a) {
            const Arg& x = args[a];
            if (x.kind == 'b' && is_output[x.buffer]) {
                const std::vector<unsigned char>& buf = buffers[x.buffer];
                if (buf.size() != sizes[x.buffer]) fail("a buffer changed size");
                if (std::fwrite(buf.data(), 1, buf.size(), out) != buf.size()) fail("cannot write the output");
            }
        }
        std::fflush(out);
    }
    std::fclose(out);
    return 0;
}
