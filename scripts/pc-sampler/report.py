#!/usr/bin/env python3
"""Sums pc_sampler's samples by function: the innermost function at each
address (inlined code counts as itself) and the function it was inlined
into. Addresses in programs built with debug information are named by
addr2line; others by the dynamic symbol dladdr found."""
import collections
import subprocess
import sys


def frames_by_address(module, offsets):
    """addr2line -a -f -i: each address, then (function, place) per frame."""
    lines = subprocess.run(['addr2line', '-a', '-f', '-i', '-C', '-e', module, *offsets],
                           capture_output=True, text=True, check=False).stdout.splitlines()
    frames, current, i = {}, None, 0
    while i < len(lines):
        if lines[i].startswith('0x'):
            current = int(lines[i], 16)
            frames[current] = []
            i += 1
        else:
            frames[current].append(lines[i].split('(')[0])
            i += 2
    return frames


def main(path, top=40):
    by_module = collections.defaultdict(list)
    for line in open(path, encoding='utf-8'):
        count, module, offset, symbol = line.split()
        by_module[module].append((int(count), offset, symbol))
    innermost, enclosing, total = collections.Counter(), collections.Counter(), 0
    for module, samples in by_module.items():
        total += sum(count for count, _, _ in samples)
        if module == '?' or '.so' in module.rsplit('/', 1)[-1]:
            for count, _, symbol in samples:
                name = f"{symbol} ({module.rsplit('/', 1)[-1]})"
                innermost[name] += count
                enclosing[name] += count
            continue
        frames = frames_by_address(module, [offset for _, offset, _ in samples])
        for count, offset, _ in samples:
            names = frames.get(int(offset, 16)) or ['??']
            innermost[names[0]] += count
            enclosing[names[-1]] += count
    print(f'{total} samples')
    for title, counter in (('innermost function', innermost), ('enclosing function', enclosing)):
        print(f'\n{title}:')
        for name, count in counter.most_common(top):
            print(f'{count:9d} {100 * count / total:6.2f}%  {name}')


if __name__ == '__main__':
    main(sys.argv[1])
