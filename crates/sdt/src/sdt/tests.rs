//! Whole-module tests: specs from real CPython notes, and property tests.

use proptest::prelude::*;

use super::fakes::{FakeMemory, FakeRegs};
use super::*;

fn reg(name: &str) -> Register {
    Register::from_name(name).expect("test register")
}

fn no_symbols(_: &str) -> Option<u64> {
    None
}

/// (spec text from a CPython `.note.stapsdt`, canonical display of each arg)
const CPYTHON_SPECS: &[(&str, &[&str])] = &[
    // function__entry / function__return (filename, funcname, lineno)
    ("8@%rbp 8@%r12 -4@%eax", &["8@%rbp", "8@%r12", "-4@%eax"]),
    (
        "8@%r14 8@%r13 -4@-84(%rbp)",
        &["8@%r14", "8@%r13", "-4@-84(%rbp)"],
    ),
    // gc__start (generation), gc__done (collected)
    ("-4@%ebx", &["-4@%ebx"]),
    ("8@%rax 8@%rdx", &["8@%rax", "8@%rdx"]),
    ("-4@112(%rsp)", &["-4@112(%rsp)"]),
];

#[test]
fn cpython_specs_parse_and_display() {
    for (text, canonical) in CPYTHON_SPECS {
        let args = parse_args(text).expect("CPython spec parses");
        let shown: Vec<String> = args.iter().map(ToString::to_string).collect();
        assert_eq!(&shown, canonical, "{text}");
    }
}

#[test]
fn cpython_function_entry_evaluates() {
    let args = parse_args("8@%rbp 8@%r12 -4@%eax").expect("parses");
    let mut regs = FakeRegs::default();
    regs.set(RegFamily::Rbp, 0x7f00_dead_0000);
    regs.set(RegFamily::R12, 0x7f00_beef_0000);
    regs.set(RegFamily::Rax, 0xffff_ffff_0000_002a);
    let mem = FakeMemory::sample();
    let values: Vec<u64> = args
        .iter()
        .map(|a| evaluate(a, &regs, &mem, &no_symbols).expect("evaluates"))
        .collect();
    assert_eq!(values, [0x7f00_dead_0000, 0x7f00_beef_0000, 42]);
    assert!(args.iter().all(|a| !a.operand.reads_memory()));
    let needed = args
        .iter()
        .fold(RegSet::EMPTY, |s, a| s.union(a.operand.registers()));
    assert_eq!(
        needed.iter().collect::<Vec<_>>(),
        [RegFamily::Rax, RegFamily::Rbp, RegFamily::R12]
    );
}

#[test]
fn cpython_stack_slot_line_number() {
    // lineno in a stack slot: -4@-84(%rbp) and -4@112(%rsp)
    let mut bytes = vec![0u8; 0x80];
    bytes[8..12].copy_from_slice(&(-3i32).to_le_bytes());
    bytes[112..116].copy_from_slice(&1234i32.to_le_bytes());
    let mem = FakeMemory::at(0x1000, &bytes);
    let mut regs = FakeRegs::default();
    regs.set(RegFamily::Rbp, 0x1000 + 84 + 8);
    regs.set(RegFamily::Rsp, 0x1000);
    let lineno = parse_arg("-4@-84(%rbp)").expect("parses");
    let got = evaluate(&lineno, &regs, &mem, &no_symbols).expect("evaluates");
    assert_eq!(got as i64, -3);
    let lineno = parse_arg("-4@112(%rsp)").expect("parses");
    let got = evaluate(&lineno, &regs, &mem, &no_symbols).expect("evaluates");
    assert_eq!(got as i64, 1234);
    assert!(lineno.operand.reads_memory());
    assert_eq!(
        lineno.operand.registers().iter().collect::<Vec<_>>(),
        [RegFamily::Rsp]
    );
}

#[test]
fn brief_example_round_trips() {
    let text =
        "8@%rbp -4@%eax -4@112(%rsp) 8@-8(%rbp,%rax,8) -1@$5 8@_PyRuntime+16(%rip) 4@foo(%rip)";
    let args = parse_args(text).expect("parses");
    let shown: Vec<String> = args.iter().map(ToString::to_string).collect();
    assert_eq!(shown.join(" "), text);
    assert_eq!(args[5].operand.symbol(), Some("_PyRuntime"));
    assert!(args[5].operand.registers().is_empty());
}

#[test]
fn from_str_parses_one_arg() {
    let a: ArgSpec = "-2@%r11w".parse().expect("parses");
    assert_eq!(
        a,
        ArgSpec {
            size: 2,
            signed: true,
            operand: Operand::Register(reg("r11w")),
        }
    );
    assert!("8@%rax 8@%rbx".parse::<ArgSpec>().is_err());
}

// ---- property tests -------------------------------------------------------

fn any_register() -> impl Strategy<Value = Register> {
    proptest::sample::select(Register::all().collect::<Vec<_>>())
}

fn general_families() -> Vec<RegFamily> {
    RegFamily::ALL
        .into_iter()
        .filter(|f| *f != RegFamily::Rip)
        .collect()
}

fn any_memory() -> impl Strategy<Value = MemOperand> {
    let displacement = prop_oneof![
        any::<i64>().prop_map(Displacement::Absolute),
        (-4096i64..4096).prop_map(Displacement::Absolute),
        ("[A-Za-z_.][A-Za-z0-9_.$]{0,12}", any::<i64>())
            .prop_map(|(name, offset)| Displacement::Symbol { name, offset }),
    ];
    let index_families: Vec<RegFamily> = general_families()
        .into_iter()
        .filter(|f| *f != RegFamily::Rsp)
        .collect();
    (
        displacement,
        any::<bool>(),
        proptest::option::of(proptest::sample::select(general_families())),
        proptest::option::of((
            proptest::sample::select(index_families),
            proptest::sample::select(vec![1u8, 2, 4, 8]),
        )),
        any::<bool>(),
    )
        .prop_map(|(displacement, addr32, base, index, rip)| {
            let width = if addr32 {
                RegWidth::Dword
            } else {
                RegWidth::Qword
            };
            let part = |f| Register::new(f, width, false);
            let base = if rip && index.is_none() {
                Some(Register::full(RegFamily::Rip))
            } else {
                base.and_then(part)
            };
            let (index, scale) = match index {
                Some((f, scale)) => (part(f), scale),
                None => (None, 1),
            };
            let scale = if index.is_some() { scale } else { 1 };
            MemOperand {
                displacement,
                base,
                index,
                scale,
            }
        })
}

fn any_arg() -> impl Strategy<Value = ArgSpec> {
    let operand = prop_oneof![
        any_register().prop_map(Operand::Register),
        any::<i64>().prop_map(Operand::Immediate),
        any_memory().prop_map(Operand::Memory),
    ];
    (
        proptest::sample::select(vec![1u8, 2, 4, 8]),
        any::<bool>(),
        operand,
    )
        .prop_map(|(size, signed, operand)| ArgSpec {
            size,
            signed,
            operand,
        })
}

/// A memory whose every byte is a function of its address and a seed.
struct PatternMemory(u64);

impl MemoryReader for PatternMemory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if address % 7 == 3 {
            return Err(std::io::ErrorKind::Other.into());
        }
        for (i, b) in buf.iter_mut().enumerate() {
            let a = address.wrapping_add(i as u64) ^ self.0;
            *b = a.to_le_bytes()[(a % 8) as usize];
        }
        Ok(())
    }
}

/// Parses `text`; when it parses, checks the result is canonical-round-trippable
/// and that evaluation does not panic. Errors must point inside the text.
fn check_total(text: &str, regs: &[u64; 17], seed: u64) {
    match parse_args(text) {
        Ok(args) => {
            let mut fake = FakeRegs::default();
            for (family, value) in RegFamily::ALL.into_iter().zip(regs) {
                fake.set(family, *value);
            }
            let resolver = |name: &str| name.starts_with('_').then_some(seed);
            for arg in &args {
                let shown = arg.to_string();
                assert_eq!(parse_arg(&shown).as_ref(), Ok(arg), "{text:?} -> {shown:?}");
                let _ = evaluate(arg, &fake, &PatternMemory(seed), &resolver);
            }
        }
        Err(e) => {
            assert!(e.position <= text.len());
            assert!(text.is_char_boundary(e.position));
            assert_eq!(e.spec, text);
            assert!(e.to_string().contains(&format!("at byte {}", e.position)));
        }
    }
}

const TOKENS: &[&str] = &[
    "8@",
    "-4@",
    "1@",
    "-2@",
    "3@",
    "@",
    "%rax",
    "%eax",
    "%ah",
    "%r8b",
    "%sil",
    "%rip",
    "%rsp",
    "%esp",
    "%r15d",
    "%",
    "$",
    "-",
    "+",
    "0x",
    "0",
    "1",
    "16",
    "-84",
    "ffff",
    "(",
    ")",
    ",",
    ",8",
    ",3",
    "foo",
    "_PyRuntime",
    ".L$1",
    " ",
    "\t",
    "99999999999999999999",
];

proptest! {
    #[test]
    fn never_panics_on_any_string(text in any::<String>(), regs in any::<[u64; 17]>(), seed in any::<u64>()) {
        check_total(&text, &regs, seed);
    }

    #[test]
    fn never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64), seed in any::<u64>()) {
        let text = String::from_utf8_lossy(&bytes);
        check_total(&text, &[seed; 17], seed);
    }

    #[test]
    fn never_panics_on_grammar_alphabet(
        text in "[-0-9a-zA-Z%$@(),+._ \t]{0,48}",
        regs in any::<[u64; 17]>(),
        seed in any::<u64>(),
    ) {
        check_total(&text, &regs, seed);
    }

    #[test]
    fn never_panics_on_token_soup(
        tokens in proptest::collection::vec(proptest::sample::select(TOKENS), 0..16),
        regs in any::<[u64; 17]>(),
        seed in any::<u64>(),
    ) {
        check_total(&tokens.concat(), &regs, seed);
    }

    #[test]
    fn display_round_trips(args in proptest::collection::vec(any_arg(), 0..6)) {
        let text = args.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
        prop_assert_eq!(parse_args(&text), Ok(args.clone()));
        for arg in &args {
            prop_assert_eq!(&arg.to_string().parse::<ArgSpec>(), &Ok(arg.clone()));
        }
    }

    #[test]
    fn evaluation_never_panics(
        arg in any_arg(),
        regs in any::<[u64; 17]>(),
        seed in any::<u64>(),
        resolves in any::<bool>(),
    ) {
        let mut fake = FakeRegs::default();
        for (family, value) in RegFamily::ALL.into_iter().zip(regs) {
            fake.set(family, value);
        }
        let resolver = |_: &str| resolves.then_some(seed);
        match evaluate(&arg, &fake, &PatternMemory(seed), &resolver) {
            Ok(value) => {
                // The value is the sign/zero extension of its low `size` bytes.
                let bits = u32::from(arg.size) * 8;
                if bits < 64 {
                    let high = value >> bits;
                    let negative = (value >> (bits - 1)) & 1 == 1;
                    if arg.signed && negative {
                        prop_assert_eq!(high, u64::MAX >> bits);
                    } else {
                        prop_assert_eq!(high, 0);
                    }
                }
            }
            Err(EvalError::UnresolvedSymbol { symbol }) => {
                prop_assert!(!resolves);
                prop_assert_eq!(Some(symbol.as_str()), arg.operand.symbol());
            }
            Err(EvalError::MemoryRead { .. }) => prop_assert!(arg.operand.reads_memory()),
            Err(EvalError::InvalidSize(_)) => prop_assert!(false, "valid sizes only"),
        }
    }
}
