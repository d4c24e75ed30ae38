use super::*;
use std::collections::HashMap;

fn launch(vars: &[(&str, &str)]) -> Result<Launch> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Launch::from_vars(&|k| map.get(k).cloned())
}

fn variable(e: Error) -> String {
    match e {
        Error::LaunchEnv { variable, .. } => variable,
        other => panic!("{other:?}"),
    }
}

const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29511")];

#[test]
fn torchrun() {
    let mut v = vec![
        ("RANK", "5"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
    ];
    v.extend(MASTER);
    let l = launch(&v).unwrap();
    assert_eq!(
        l,
        Launch {
            rank: 5,
            world_size: 16,
            local_rank: Some(1),
            local_world_size: Some(4),
            master_addr: "node0".into(),
            master_port: 29511,
            source: LaunchSource::Torchrun,
        }
    );
}

#[test]
fn the_store_port_avoids_torchruns_own_store() {
    let mut v = vec![("RANK", "0"), ("WORLD_SIZE", "2")];
    v.extend(MASTER);
    assert_eq!(launch(&v).unwrap().master_port, 29511);
    v.push(("TORCHELASTIC_RUN_ID", "none"));
    assert_eq!(launch(&v).unwrap().master_port, 29512);
    v.push(("SYMMPOOL_STORE_PORT", "40000"));
    assert_eq!(launch(&v).unwrap().master_port, 40000);
    let mut bad = v.clone();
    bad.retain(|(k, _)| *k != "SYMMPOOL_STORE_PORT");
    bad.push(("SYMMPOOL_STORE_PORT", "x"));
    assert_eq!(variable(launch(&bad).unwrap_err()), "SYMMPOOL_STORE_PORT");
    // Under slurm too, and without MASTER_PORT at all.
    let slurm = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("MASTER_ADDR", "node0"),
        ("SYMMPOOL_STORE_PORT", "40001"),
    ];
    assert_eq!(launch(&slurm).unwrap().master_port, 40001);
    let mut top = vec![
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("TORCHELASTIC_RUN_ID", "r"),
    ];
    top.extend([("MASTER_ADDR", "node0"), ("MASTER_PORT", "65535")]);
    assert_eq!(variable(launch(&top).unwrap_err()), "MASTER_PORT");
}

#[test]
fn slurm_and_open_mpi() {
    let mut v = vec![
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "3"),
    ];
    v.extend(MASTER);
    let l = launch(&v).unwrap();
    assert_eq!((l.rank, l.world_size, l.local_rank), (3, 8, Some(3)));
    assert_eq!((l.local_world_size, l.source), (None, LaunchSource::Slurm));
    let mut v = vec![
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    v.extend(MASTER);
    let l = launch(&v).unwrap();
    assert_eq!(
        (l.rank, l.world_size, l.source),
        (0, 2, LaunchSource::OpenMpi)
    );
    // torchrun's variables win over slurm's.
    let mut v = vec![("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "0")];
    v.extend(MASTER);
    assert_eq!(launch(&v).unwrap().source, LaunchSource::Torchrun);
}

#[test]
fn errors_name_the_variable() {
    assert_eq!(variable(launch(&[]).unwrap_err()), "RANK");
    assert_eq!(
        variable(launch(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err()),
        "RANK"
    );
    assert_eq!(
        variable(launch(&[("RANK", "0")]).unwrap_err()),
        "WORLD_SIZE"
    );
    assert_eq!(
        variable(launch(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err()),
        "MASTER_ADDR"
    );
    assert_eq!(
        variable(
            launch(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "70000")
            ])
            .unwrap_err()
        ),
        "MASTER_PORT"
    );
    let refused = |vars: &[(&'static str, &'static str)]| {
        let v: Vec<_> = vars.iter().chain(&MASTER).copied().collect();
        variable(launch(&v).unwrap_err())
    };
    assert_eq!(refused(&[("RANK", "2"), ("WORLD_SIZE", "2")]), "RANK");
    assert_eq!(
        refused(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "-1"),
        ]),
        "SLURM_LOCALID"
    );
    assert_eq!(
        refused(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]),
        "OMPI_COMM_WORLD_LOCAL_RANK"
    );
    assert!(Launch::explicit(0, 0, "h", 1).is_err());
    assert!(Launch::explicit(1, 2, "h", 1).is_ok());
}
